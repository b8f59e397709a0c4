"""How well a text-to-image model follows shapes-world prompts (default: the embedded txt2img-shapes).

One image per held-out prompt (single-object scenes of the test seed split, fixed seeds), judged
independently of the model: the shape by the default classifier (vit-shapes), the object's colour and
the background's colour by the palette, the position on the 3x3 grid and the size where the prompt
names them (``gencli.data.shapes_txt2img.judge_image``). Reports the share of images matching their
prompt in every named attribute and per attribute, the same for the colour+shape pairs held out of
training, the judges' own accuracy on the true scenes passed through the autoencoder, the diversity of
16 seeds of one prompt (mean pairwise pixel distance) and seconds per image.

    python scripts/eval_txt2img.py                      # 400 + 120 held-out-pair prompts
    python scripts/eval_txt2img.py --n 100 --held-out 40 --json
    python scripts/eval_txt2img.py --engine diffusers   # the same folder through diffusers
    python scripts/eval_txt2img.py --grid docs/txt2img-shapes-grid.png   # only the README's grid
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gencli.data import shapes  # noqa: E402
from gencli.data.shapes_txt2img import ATTRIBUTES, EvalItem, eval_items, judge_image, score  # noqa: E402
from gencli.weights import weights_dir  # noqa: E402

GRID_PROMPTS = (
    "a red star on a blue background",
    "a yellow circle on a black background",
    "a large green square at the top left on a white background",
    "a small purple heart at the bottom right",
    "a white crescent on a red background",
    "an orange diamond in the center on a gray background",
)

Generate = Callable[[list[str], list[int]], np.ndarray]  # prompts, seeds -> (N, H, W, 3) uint8


def gencli_generator(model: Path, args) -> Generate:
    from gencli.pipelines.diffusion.pipeline import generate, load_pipeline, resolve_settings

    pipe = load_pipeline(model, device=args.device, dtype=args.dtype, threads=args.threads)
    settings = resolve_settings(pipe, steps=args.steps, guidance=args.guidance, sampler=args.sampler)

    def run_batch(prompts: list[str], seeds: list[int]) -> np.ndarray:
        return np.stack([img.pixels for img in generate(pipe, prompts, seeds, settings)])

    return run_batch


def write_grid(generate: Generate, path: Path, seeds: int = 4, scale: int = 2) -> None:
    """The README's grid: one row per prompt of GRID_PROMPTS, one column per seed 0..seeds-1,
    upscaled ``scale`` times (nearest neighbour), with a 2-pixel white gutter."""
    from PIL import Image

    from gencli.io import atomic_path

    rows = [generate([prompt] * seeds, list(range(seeds))) for prompt in GRID_PROMPTS]
    h, w = rows[0].shape[1:3]
    gap = 2
    grid = np.full((len(rows) * (h * scale + gap) - gap, seeds * (w * scale + gap) - gap, 3), 255, np.uint8)
    for r, images in enumerate(rows):
        for c, img in enumerate(images):
            y, x = r * (h * scale + gap), c * (w * scale + gap)
            grid[y : y + h * scale, x : x + w * scale] = img.repeat(scale, 0).repeat(scale, 1)
    with atomic_path(path, force=True) as tmp:
        Image.fromarray(grid).save(tmp, format="PNG", optimize=True)
    print(f"wrote {path} ({len(GRID_PROMPTS)} prompts x seeds 0-{seeds - 1})")


def diffusers_generator(model: Path, args) -> Generate:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers import StableDiffusionPipeline

    torch.set_num_threads(args.threads or torch.get_num_threads())
    pipe = StableDiffusionPipeline.from_pretrained(str(model), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    defaults = json.loads((model / "generation_config.json").read_text()) if (model / "generation_config.json").exists() else {}

    def generate(prompts: list[str], seeds: list[int]) -> np.ndarray:
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        out = pipe(
            prompts,
            num_inference_steps=args.steps or defaults.get("num_inference_steps", 25),
            guidance_scale=args.guidance if args.guidance is not None else defaults.get("guidance_scale", 5.0),
            generator=gens,
            output_type="np",
        ).images
        return (np.clip(out, 0, 1) * 255).round().astype(np.uint8)

    return generate


def classify_shapes(images: np.ndarray, args) -> list[str]:
    from PIL import Image

    from gencli.pipelines.vision.classify import ImageClassifier

    clf = ImageClassifier.load(weights_dir() / "vit-shapes", device="cpu", dtype="float32", threads=args.threads)
    out: list[str] = []
    for i in range(0, len(images), 64):
        preds = clf.predict([Image.fromarray(a) for a in images[i : i + 64]], top_k=1)
        out.extend(p[0]["label"] for p in preds)
    return out


def judge(items: list[EvalItem], images: np.ndarray, args) -> dict:
    predicted = classify_shapes(images, args)
    per = {a: [] for a in ATTRIBUTES}
    full = []
    for item, image, shape in zip(items, images, predicted):
        judged = {**judge_image(image, shape), "shape": shape}
        s = score(item.named, judged)
        for k, v in s.items():
            per[k].append(v)
        full.append(all(s.values()))
    return {
        "n": len(items),
        "all_named_attributes": round(float(np.mean(full)), 4),
        **{a: round(float(np.mean(v)), 4) for a, v in per.items() if v},
        "named_counts": {a: len(v) for a, v in per.items()},
    }


def run(generate: Generate, items: list[EvalItem], batch: int) -> tuple[np.ndarray, float]:
    images, t0 = [], time.perf_counter()
    for i in range(0, len(items), batch):
        chunk = items[i : i + batch]
        images.append(generate([it.prompt for it in chunk], [it.seed for it in chunk]))
    return np.concatenate(images), (time.perf_counter() - t0) / len(items)


def diversity(generate: Generate, prompt: str, n: int = 16) -> float:
    """Mean pairwise mean-absolute pixel distance (0-1) between the images of ``n`` seeds."""
    images = generate([prompt] * n, list(range(n))).astype(np.float32) / 255
    return float(np.mean([np.abs(a - b).mean() for a, b in itertools.combinations(images, 2)]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=weights_dir() / "txt2img-shapes")
    p.add_argument("--engine", choices=("gencli", "diffusers"), default="gencli")
    p.add_argument("--n", type=int, default=400, help="prompts with colour+shape pairs seen in training")
    p.add_argument("--held-out", type=int, default=120, help="prompts with the colour+shape pairs held out of training")
    p.add_argument("--steps", type=int, default=None, help="default: the model's generation_config.json")
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--sampler", default=None)
    p.add_argument("--batch", type=int, default=40)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--diversity-prompt", default="a red star on a blue background")
    p.add_argument("--judges", action="store_true", help="also the judges' accuracy on the true scenes through the autoencoder")
    p.add_argument("--json", action="store_true")
    p.add_argument("--grid", type=Path, default=None, help="only write the README's grid of samples (PNG) to this path")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    generate = (gencli_generator if args.engine == "gencli" else diffusers_generator)(args.model, args)
    if args.grid is not None:
        write_grid(generate, args.grid)
        return
    report: dict = {"model": str(args.model), "engine": args.engine}
    seen = eval_items(args.n)
    images, spi = run(generate, seen, args.batch)
    report["seen_pairs"] = judge(seen, images, args)
    report["seconds_per_image"] = round(spi, 3)
    if args.held_out:
        held = eval_items(args.held_out, held_out=True)
        report["held_out_pairs"] = judge(held, run(generate, held, args.batch)[0], args)
    report["diversity_16_seeds"] = round(diversity(generate, args.diversity_prompt), 4)
    if args.judges:
        from gencli.backend.device import Placement
        from gencli.pipelines.diffusion.vae import load_autoencoder, reconstruct

        vae = load_autoencoder(args.model / "vae", Placement(torch.device("cpu"), torch.float32)).model
        truth = np.stack([shapes.render_scene(it.scene, 64) for it in seen])
        report["judges_on_true_scenes_through_vae"] = judge(seen, reconstruct(vae, truth)[0], args)
    if args.json:
        print(json.dumps(report))
        return
    for key in ("seen_pairs", "held_out_pairs", "judges_on_true_scenes_through_vae"):
        if key in report:
            r = report[key]
            cols = " ".join(f"{a} {r[a]:.3f}" for a in ATTRIBUTES if a in r)
            print(f"{key:34s} n={r['n']:4d}  all named {r['all_named_attributes']:.3f}  {cols}")
    print(f"diversity (16 seeds, '{args.diversity_prompt}'): {report['diversity_16_seeds']:.4f}; {report['seconds_per_image']:.3f} s/image")


if __name__ == "__main__":
    main()
