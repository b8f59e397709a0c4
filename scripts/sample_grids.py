#!/usr/bin/env python
"""The README's sample grids: 16 held-out shapes-world scenes next to 16 samples of each embedded
generative default, all 64x64, drawn by ``gencli sample`` as a user would (seeds 0-15, each model's
default settings: the GAN at truncation 1, the VAE at temperature 1, the DDPM with its 100 ancestral steps).

    python scripts/sample_grids.py --out-dir docs/sample-grids

Writes ``real.png``, ``gan.png``, ``vae.png`` and ``ddpm.png`` (4x4 grids, 2-pixel gaps) and prints the
commands it ran.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gencli.data import shapes  # noqa: E402
from gencli.pipelines.generative.outputs import image_grid  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "sample-grids")
    p.add_argument("--seeds", default="0-15")
    p.add_argument("--families", default="gan,vae,ddpm")
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    lo, hi = (int(v) for v in args.seeds.split("-"))
    n = hi - lo + 1
    real, _ = shapes.render_batch(shapes.split_seeds("test", n, offset=lo), 64)
    grid = image_grid(np.stack([np.asarray(im) for im in real]), nrow=round(n**0.5))
    Image.fromarray(grid).save(args.out_dir / "real.png")
    print(f"real.png: test-split scenes {lo}..{hi}")
    for family in args.families.split(","):
        cmd = [sys.executable, "-m", "gencli", "sample", family, "--seeds", args.seeds, "-o", str(args.out_dir / f"{family}.png"), "--force"]
        print("$ gencli " + shlex.join(cmd[3:]), flush=True)
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
