#!/usr/bin/env python
"""Zero-shot accuracy of a CLIP model on held-out shapes-world scenes, through gencli's own pipeline.

    python scripts/eval_clip.py                        # the embedded default, test split, auto dtype
    python scripts/eval_clip.py --model runs/clip/model --split validation --n 400

Single-object scenes from a seed range training never used, drawn at ``--size`` pixels and read
through the checkpoint's preprocessing (as ``gencli zeroshot`` does), classified against three label
sets that no training caption used verbatim (see :mod:`gencli.data.shapes_clip`):

- shape:        the 8 shapes,                      prompt "a photo of a {}."
- colour:       the 10 colours,                    prompt "a photo of a {} shape."
- colour+shape: all 80 combinations ("purple heart"), prompt "a photo of a {}."

on ordinary scenes and on scenes of the eight colour+shape pairs held out of training. Prints one
JSON object (and a markdown table with --markdown).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run_eval(model: str, *, split: str = "test", n: int = 1000, n_held_out: int = 800, size: int = 64, dtype: str = "auto", device: str = "auto",
             shape_template=None, colour_template=None, combo_template=None, threads=None) -> dict:  # fmt: skip
    from PIL import Image

    from gencli.backend.device import DTYPE_NAMES, choose
    from gencli.data import shapes_clip
    from gencli.pipelines import zeroshot as zs
    from gencli.weights import resolve_model

    placement = choose(device, dtype, "transformer", threads)
    bundle = zs.load(resolve_model(model, zs.DEFAULT_MODEL), placement)
    kwargs = {k: v for k, v in dict(shape_template=shape_template, colour_template=colour_template, combo_template=combo_template).items() if v}
    sets = shapes_clip.label_sets(**kwargs)

    def enc_images(arrays):
        return zs.encode_images(bundle, [Image.fromarray(a) for a in arrays])

    start = time.perf_counter()
    result = {"model": str(bundle.path), "split": split, "dtype": DTYPE_NAMES[placement.dtype], "image_size": size, "templates": {s.name: s.template for s in sets}}
    ordinary = shapes_clip.evaluate(enc_images, bundle.encode_texts, shapes_clip.eval_scenes(split, n), sets, size=size)
    held = shapes_clip.evaluate(enc_images, bundle.encode_texts, shapes_clip.eval_scenes(split, n_held_out, held_out=True, offset=500_000), sets, size=size)
    result["n"] = n
    result["n_held_out"] = n_held_out
    result["accuracy"] = {k: round(v, 4) for k, v in ordinary.items()}
    result["accuracy_held_out_pairs"] = {k: round(v, 4) for k, v in held.items()}
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder or embedded name (default: the embedded CLIP)")
    p.add_argument("--split", default="test", choices=["validation", "test"])
    p.add_argument("--n", type=int, default=1000, help="ordinary scenes")
    p.add_argument("--n-held-out", type=int, default=800, help="scenes of the held-out colour+shape pairs")
    p.add_argument("--size", type=int, default=64, help="render size of the scenes (the preprocessing resizes)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--shape-template")
    p.add_argument("--colour-template")
    p.add_argument("--combo-template")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    res = run_eval(args.model, split=args.split, n=args.n, n_held_out=args.n_held_out, size=args.size, dtype=args.dtype, device=args.device,
                   shape_template=args.shape_template, colour_template=args.colour_template, combo_template=args.combo_template, threads=args.threads)  # fmt: skip
    print(json.dumps(res))
    if args.markdown:
        print()
        print("| label set | prompt | top-1, held-out scenes | top-1, held-out colour+shape pairs |")
        print("|---|---|---|---|")
        for name, template in res["templates"].items():
            print(f"| {name} | `{template}` | {res['accuracy'][name]:.1%} | {res['accuracy_held_out_pairs'][name]:.1%} |")


if __name__ == "__main__":
    main()
