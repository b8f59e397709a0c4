"""``classify --ray``: a directory of generated images classified in one process (reference) vs on a
local Ray runtime with ``--replicas`` model replicas (gencli side), the same command line otherwise,
JSON lines out.

Both sides run the real command (``python -m gencli classify DIR --json ...``, the embedded default
classifier unless ``--model``) in a subprocess with one torch thread per process, once on one image
(the start-up: imports and the model load, for ``--ray`` also starting Ray and the replicas) and
once on the directory; the gencli side checks that its output is the reference's, byte for byte.
The sampling of the replicas' memory is the forecast case's (:mod:`bench_cases.ray`).
"""

from __future__ import annotations

import os
from pathlib import Path

from bench_cases.ray import _digest, _timed, gencli_command

DESCRIPTION = "classify a directory of N generated images: one process vs --ray local --replicas R (throughput, start-up, peak memory per replica)"
METRICS = {"images_per_s": "higher", "startup_s": "lower", "wall_s": "lower"}


def add_arguments(p):
    p.add_argument("--images", type=int, default=300)
    p.add_argument("--size", type=int, default=64, help="image side in pixels")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--model", default=None, help="classifier folder (default: the embedded default)")


def setup(args, workdir):
    from gencli.data import shapes

    (workdir / "images").mkdir()
    (workdir / "one").mkdir()
    for i, seed in enumerate(shapes.split_seeds("test", args.images)):
        shapes.render(seed, args.size).pil().save(workdir / "images" / f"img{i:05d}.png")
    shapes.render(0, args.size).pil().save(workdir / "one" / "img.png")


def _command(args, folder: Path, out: str, ray: bool) -> list[str]:
    return gencli_command("classify", folder, out, args, ray, "--json")


def run(side, args, workdir):
    ray = side == "gencli"
    startup = _timed(_command(args, workdir / "one", os.devnull, ray), replica="ImageReplica")
    out = workdir / f"out-{side}.jsonl"
    t = _timed(_command(args, workdir / "images", str(out), ray), replica="ImageReplica")
    result = {
        "images": args.images,
        "wall_s": round(t["wall"], 2),
        "images_per_s": round(args.images / t["wall"], 1),
        "startup_s": round(startup["wall"], 2),
        "steady_images_per_s": round(args.images / (t["wall"] - startup["wall"]), 1) if t["wall"] > startup["wall"] else None,
        "peak_rss_mb": t["command_mb"],
    }
    if ray:
        ref = workdir / "out-reference.jsonl"
        result.update(
            {
                "replicas": args.replicas,
                "replicas_seen": t["replicas_seen"],
                "replica_peak_rss_mb": t["replica_mb"],
                "identical": _digest(ref) == _digest(out) if ref.exists() else None,
            }
        )
    return result
