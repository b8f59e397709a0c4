"""How well a text-to-image model follows shapes-world prompts (default: the embedded txt2img-shapes).

One image per held-out prompt (single-object scenes of the test seed split, fixed seeds), judged
independently of the model: the shape by the default classifier (vit-shapes), the object's colour and
the background's colour by the palette, the position on the 3x3 grid and the size where the prompt
names them (``gencli.data.shapes_txt2img.judge_image``). Reports the share of images matching their
prompt in every named attribute and per attribute, the same for the colour+shape pairs held out of
training, the judges' own accuracy on the true scenes passed through the autoencoder, the diversity of
16 seeds of one prompt (mean pairwise pixel distance) and seconds per image.

``--lora FILE:WEIGHT`` merges a LoRA first (as ``gencli txt2img --lora``). ``--shape arrow`` (or
``hexagon``) asks for a shape of ``shapes.EXTRA_SHAPES`` instead (the same test seeds, captions and
named attributes, each scene's object drawn as that shape): the classifier knows only the eight shapes,
so the shape is judged by fitting the shape templates of all of ``shapes.ALL_SHAPES``
(``eval_generative.GeometricJudge``) to the main object, and the report adds what the images were
drawn as (the templates' verdicts).

    python scripts/eval_txt2img.py                      # 400 + 120 held-out-pair prompts
    python scripts/eval_txt2img.py --n 100 --held-out 40 --json
    python scripts/eval_txt2img.py --engine diffusers   # the same folder through diffusers
    python scripts/eval_txt2img.py --grid docs/txt2img-shapes-grid.png   # only the README's grid
    python scripts/eval_txt2img.py --shape arrow --n 200 --lora weights/lora-arrow/lora-arrow.safetensors:0.5
    python scripts/eval_txt2img.py --shape arrow --lora-grid docs/txt2img-lora-arrow-grid.png --lora weights/lora-arrow/lora-arrow.safetensors
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

LORA_GRID_PROMPTS = (  # {shape}: the new shape the LoRA teaches
    "a red {shape} on a white background",
    "a large yellow {shape} on a blue background",
    "a small green {shape} at the top left on a black background",
    "a picture of a purple {shape} on the right, on a gray background",
)
LORA_GRID_WEIGHTS = (0.0, 0.5, 1.0)

Generate = Callable[[list[str], list[int]], np.ndarray]  # prompts, seeds -> (N, H, W, 3) uint8


def gencli_generator(model: Path, args) -> Generate:
    from gencli.pipelines.diffusion.lora import parse_lora_option
    from gencli.pipelines.diffusion.pipeline import generate, load_pipeline, resolve_settings

    loras = [parse_lora_option(text) for text in args.lora]
    pipe = load_pipeline(model, device=args.device, dtype=args.dtype, threads=args.threads, loras=loras)
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


def write_lora_grid(model: Path, args, path: Path, seeds: int = 2, scale: int = 2) -> None:
    """A LoRA's grid: one row per prompt of LORA_GRID_PROMPTS (for ``args.shape``); per weight of LORA_GRID_WEIGHTS (0:
    without it) the images of seeds 0..seeds-1; nearest-neighbour upscaled, 2-pixel white gutters
    (6 between the weights)."""
    from PIL import Image

    from gencli.io import atomic_path
    from gencli.pipelines.diffusion.lora import parse_lora_option

    if len(args.lora) != 1:
        raise SystemExit("--lora-grid needs one --lora FILE")
    file = parse_lora_option(args.lora[0]).path
    columns = []  # per weight: (prompts, seeds, H, W, 3)
    for weight in LORA_GRID_WEIGHTS:
        args_w = argparse.Namespace(**{**vars(args), "lora": [f"{file}:{weight}"] if weight else []})
        generate = gencli_generator(model, args_w)
        prompts = [p.format(shape=args.shape or "arrow") for p in LORA_GRID_PROMPTS]
        columns.append(np.stack([generate([prompt] * seeds, list(range(seeds))) for prompt in prompts]))
    h, w = columns[0].shape[2:4]
    gap, group_gap = 2, 6
    cell_w, cell_h = w * scale, h * scale
    group_w = seeds * (cell_w + gap) - gap
    grid = np.full((len(LORA_GRID_PROMPTS) * (cell_h + gap) - gap, len(columns) * (group_w + group_gap) - group_gap, 3), 255, np.uint8)
    for g, column in enumerate(columns):
        for r in range(len(LORA_GRID_PROMPTS)):
            for c in range(seeds):
                y, x = r * (cell_h + gap), g * (group_w + group_gap) + c * (cell_w + gap)
                grid[y : y + cell_h, x : x + cell_w] = column[r, c].repeat(scale, 0).repeat(scale, 1)
    with atomic_path(path, force=True) as tmp:
        Image.fromarray(grid).save(tmp, format="PNG", optimize=True)
    print(f"wrote {path} ({len(LORA_GRID_PROMPTS)} prompts x LoRA weights {', '.join(f'{x:g}' for x in LORA_GRID_WEIGHTS)} x seeds 0-{seeds - 1})")


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


# A hexagon and a circle of the same area differ by a few per cent of IoU, less than the autoencoder's
# rounding of corners; where the templates choose between them, the six-fold symmetry of the
# object's outline decides: the amplitude of the sixth harmonic of its radius (the sum of the soft
# coverage along 96 rays from the centroid), relative to the mean radius. Drawn scenes: circles
# below 0.002, hexagons 0.024-0.028; through the autoencoder (test seeds, 30 per cell, 5th-95th
# percentile): circles 0.0007-0.008 at every size, hexagons 0.003-0.012 small, 0.011-0.023 medium,
# 0.022-0.028 large: small hexagons are mostly lost in the autoencoder itself.
HEXAGON_HARMONIC = 0.01


def six_fold(alpha: np.ndarray) -> float:
    """The sixth harmonic's amplitude of an object's radius around its centroid, relative to the mean radius."""
    from scipy import ndimage

    area = float(alpha.sum())
    ys, xs = np.mgrid[0 : alpha.shape[0], 0 : alpha.shape[1]]
    cy, cx = float((alpha * ys).sum() / area), float((alpha * xs).sum() / area)
    theta = np.linspace(0.0, 2 * np.pi, 96, endpoint=False)
    steps = np.arange(0.0, float(max(alpha.shape)), 0.25)
    rows, cols = cy - np.outer(np.sin(theta), steps), cx + np.outer(np.cos(theta), steps)
    radius = ndimage.map_coordinates(alpha, [rows, cols], order=1, mode="constant").sum(1) * 0.25
    return float(np.abs((radius * np.exp(-6j * theta)).mean()) / max(float(radius.mean()), 1e-6))


def geometric_shapes(images: np.ndarray) -> list[str | None]:
    """The shape whose template (any of ``shapes.ALL_SHAPES``) fits each image's largest object best,
    circle and hexagon told apart by :func:`six_fold`; None where there is no object."""
    from scripts.eval_generative import GeometricJudge

    judge = GeometricJudge(shapes.ALL_SHAPES)
    out: list[str | None] = []
    for image in images:
        objects = judge._objects(image)
        if not objects:
            out.append(None)
            continue
        shape, _ = judge.fit(objects[0])
        if shape in ("circle", "hexagon"):
            shape = "hexagon" if six_fold(objects[0]) >= HEXAGON_HARMONIC else "circle"
        out.append(shape)
    return out


def drawn_as(verdicts: list[str | None]) -> dict[str, float]:
    """The share of each shape verdict ("none": no object found)."""
    return {(s or "none"): round(verdicts.count(s) / len(verdicts), 4) for s in (*shapes.ALL_SHAPES, None) if verdicts.count(s)}


def judge(items: list[EvalItem], images: np.ndarray, args) -> dict:
    geometric = any(it.named["shape"] not in shapes.SHAPES for it in items)
    predicted = geometric_shapes(images) if geometric else classify_shapes(images, args)
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
        **({"drawn_as": drawn_as(predicted)} if geometric else {}),
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
    p.add_argument("--lora", action="append", default=[], help="FILE[:WEIGHT]: merge this LoRA first (repeatable)")
    p.add_argument("--shape", choices=shapes.EXTRA_SHAPES, default=None, help="prompts for this new shape (judged by shape templates)")
    p.add_argument("--lora-grid", type=Path, default=None, help="only write a grid of the --lora file at weights 0, 0.5, 1 (PNG) to this path")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.lora_grid is not None:
        write_lora_grid(args.model, args, args.lora_grid)
        return
    if args.lora and args.engine != "gencli":
        raise SystemExit("--lora: only with --engine gencli")
    generate = (gencli_generator if args.engine == "gencli" else diffusers_generator)(args.model, args)
    if args.grid is not None:
        write_grid(generate, args.grid)
        return
    report: dict = {"model": str(args.model), "engine": args.engine, "loras": args.lora, "shape": args.shape}
    if args.shape:
        args.held_out = 0
        if args.diversity_prompt == p.get_default("diversity_prompt"):
            args.diversity_prompt = f"a red {args.shape} on a blue background"
    seen = eval_items(args.n, shape=args.shape)
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
    if args.judges and args.shape:
        # how often the templates call one of the eight known shapes the new one (true scenes, same path)
        known = eval_items(min(args.n, 200))
        truth = np.stack([shapes.render_scene(it.scene, 64) for it in known])
        verdicts = geometric_shapes(reconstruct(vae, truth)[0])
        report["templates_on_true_eight_shapes_through_vae"] = {
            "n": len(known),
            "correct": round(float(np.mean([v == it.scene.main.shape for v, it in zip(verdicts, known)])), 4),
            f"called_{args.shape}": round(float(np.mean([v == args.shape for v in verdicts])), 4),
        }
    if args.json:
        print(json.dumps(report))
        return
    for key in ("seen_pairs", "held_out_pairs", "judges_on_true_scenes_through_vae"):
        if key in report:
            r = report[key]
            cols = " ".join(f"{a} {r[a]:.3f}" for a in ATTRIBUTES if a in r)
            print(f"{key:34s} n={r['n']:4d}  all named {r['all_named_attributes']:.3f}  {cols}")
            if "drawn_as" in r:
                print(f"{'':34s} drawn as: " + ", ".join(f"{s} {v:.3f}" for s, v in r["drawn_as"].items()))
    if "templates_on_true_eight_shapes_through_vae" in report:
        print("templates on the true eight-shape scenes: " + json.dumps(report["templates_on_true_eight_shapes_through_vae"]))
    print(f"diversity (16 seeds, '{args.diversity_prompt}'): {report['diversity_16_seeds']:.4f}; {report['seconds_per_image']:.3f} s/image")


if __name__ == "__main__":
    main()
