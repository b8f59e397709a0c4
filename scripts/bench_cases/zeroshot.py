"""Zero-shot classification: gencli's CLIP pipeline vs transformers on a ViT-B/32-shaped random CLIP.

Both sides do the same work, end to end: load the checkpoint folder, encode 100 label prompts once,
then read the image files, preprocess them with the checkpoint's preprocessor_config.json, encode
them and score them against the labels (softmax over logit_scale * cosine), in batches.
``images_per_s`` counts the image phase; ``labels_s`` is the one-off label encoding.
"""

from __future__ import annotations

import time

from bench_cases._util import best_time, device_and_dtype, peak_gpu_mb

DESCRIPTION = "CLIP zero-shot: images/s for 100 labels, ViT-B/32-shaped random CLIP (gencli vs transformers)"
METRICS = {"images_per_s": "higher", "labels_s": "lower", "load_s": "lower", "max_prob_diff_vs_fp32": "lower"}


def add_arguments(p):
    p.add_argument("--images", type=int, default=64, help="image files scored per pass")
    p.add_argument("--batch", type=int, default=32, help="images per forward pass")
    p.add_argument("--labels", type=int, default=100)


def _labels(n: int) -> list[str]:
    from gencli.data import shapes

    pool = [f"{c} {s}" for c in shapes.COLOURS for s in shapes.SHAPES] + [f"{z} {s}" for z in shapes.SIZES for s in shapes.SHAPES]
    pool += [f"{s} on a {b} background" for b in shapes.BACKGROUNDS for s in shapes.SHAPES]
    return pool[:n]


def setup(args, workdir):
    """A ViT-B/32-shaped CLIPModel with random weights in HF layout, a CLIP-format tokenizer, and image files."""
    import ast
    import json
    from pathlib import Path

    import torch
    import transformers

    from gencli.data import shapes
    from gencli.tokenizers.clip_bpe import train_bpe

    folder = Path(workdir) / "clip-vit-b32-random"
    libdir = Path(ast.__file__).parent
    corpus = []
    for f in sorted(libdir.glob("*.py"))[:120]:
        try:
            doc = ast.get_docstring(ast.parse(f.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError):
            continue
        if doc:
            corpus.append(doc)
    corpus += _labels(args.labels) * 5
    tok = train_bpe(corpus, 4000)
    config = transformers.CLIPConfig(
        text_config=dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        vision_config={},
    )  # ViT-B/32 defaults: vision 768 x 12 layers, patch 32 at 224; text 512 x 12 layers; projection 512
    torch.manual_seed(0)
    model = transformers.CLIPModel(config)
    model.save_pretrained(str(folder), safe_serialization=True)
    tok.save(folder)
    processor = {
        "image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": 224}, "resample": 3,
        "do_center_crop": True, "crop_size": {"height": 224, "width": 224}, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
    }  # fmt: skip
    (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    images = Path(workdir) / "images"
    images.mkdir()
    for i, seed in enumerate(shapes.split_seeds("test", args.images)):
        shapes.render(seed, (320, 256)).pil().save(images / f"{i:04d}.png")
    # the fp32 reference probabilities the gencli side compares its own against
    import numpy as np

    (Path(workdir) / "labels.json").write_text(json.dumps(_labels(args.labels)))
    np.save(Path(workdir) / "ref_probs.npy", np.zeros(0))


def _paths(workdir):
    from pathlib import Path

    return sorted(str(p) for p in (Path(workdir) / "images").glob("*.png"))


def run(side, args, workdir):
    import json
    from pathlib import Path

    import numpy as np
    import torch

    device, dtype = device_and_dtype(args, side)
    folder = Path(workdir) / "clip-vit-b32-random"
    labels = json.loads((Path(workdir) / "labels.json").read_text())
    prompts = [f"a photo of a {label}." for label in labels]
    paths = _paths(workdir)
    batches = [paths[i : i + args.batch] for i in range(0, len(paths), args.batch)]

    t0 = time.perf_counter()
    if side == "reference":
        import transformers
        from PIL import Image

        model = transformers.CLIPModel.from_pretrained(str(folder), dtype=dtype).to(device).eval()
        tokenizer = transformers.CLIPTokenizer.from_pretrained(str(folder))
        processor = transformers.CLIPImageProcessor.from_pretrained(str(folder))
        load_s = time.perf_counter() - t0

        def encode_labels():
            with torch.inference_mode():
                inputs = tokenizer(prompts, padding=True, return_tensors="pt").to(device)
                emb = model.get_text_features(**inputs).pooler_output.float()
                return emb / emb.norm(dim=-1, keepdim=True)

        text = encode_labels()
        scale = model.logit_scale.exp().float().item()

        def score_all():
            out = []
            with torch.inference_mode():
                for batch in batches:
                    images = [Image.open(p).convert("RGB") for p in batch]
                    px = processor(images=images, return_tensors="pt")["pixel_values"].to(device, dtype)
                    emb = model.get_image_features(pixel_values=px).pooler_output.float()
                    emb = emb / emb.norm(dim=-1, keepdim=True)
                    out.append((scale * emb @ text.t()).softmax(dim=-1))
            return torch.cat(out)

    else:
        from gencli.backend.device import DTYPE_NAMES
        from gencli.pipelines.clip import zeroshot as zs
        from gencli.pipelines.vision.images import load_image

        bundle = zs.load(folder, device=str(device), dtype=DTYPE_NAMES[dtype], threads=args.threads)
        load_s = time.perf_counter() - t0

        def encode_labels():
            return zs.ZeroShotClassifier(bundle, labels, ["a photo of a {}."])

        clf = encode_labels()

        def score_all():
            return torch.cat([clf.scores([load_image(p) for p in batch]) for batch in batches])

    labels_s = best_time(encode_labels, device, args.repeat)
    seconds = best_time(score_all, device, args.repeat)
    probs = score_all().float().cpu().numpy()
    result = {"images_per_s": round(len(paths) / seconds, 2), "labels_s": round(labels_s, 4), "load_s": round(load_s, 3)}
    ref_file = Path(workdir) / "ref_probs.npy"
    if side == "reference" and dtype == torch.float32:
        np.save(ref_file, probs)
    ref = np.load(ref_file)
    if ref.shape == probs.shape:
        result["max_prob_diff_vs_fp32"] = float(np.abs(ref - probs).max())
        result["top1_agreement_vs_fp32"] = float((ref.argmax(-1) == probs.argmax(-1)).mean())
    gpu = peak_gpu_mb(device)
    if gpu is not None:
        result["peak_gpu_mb"] = gpu
    return result
