"""What an image encoder learnt, measured as the self-supervised literature does: a linear probe and
a k-NN classifier on frozen features, for each label of a shapes-world scene (the object's shape,
colour, position and size, and the background colour).

Features come through the path ``gencli embed --images`` uses (:func:`gencli.pipelines.vision.embed.load_image_embedder`,
each model's own preprocessing, unnormalised vectors). Probes are fitted on ``--fit`` labelled
single-object scenes of the train split (seeds far past those a training run draws) and scored on
``--test`` held-out scenes of the test split, rendered at 64x64:

- linear probe: multinomial logistic regression on the standardised features (full-batch L-BFGS,
  a small L2 penalty), accuracy on the held-out scenes;
- k-NN: the ``--k`` fitted scenes nearest by cosine similarity vote, weighted by exp(cosine / 0.07)
  (the weighting of Wu et al. 2018, also used to evaluate SimCLR-style encoders).

Encoders compared (``--models``, default all three): ``simclr`` (weights/simclr-shapes), ``random``
(the same architecture with the training run's initial weights: what the features give before any
learning), ``vit`` (the supervised weights/vit-shapes classifier's [CLS] feature; it was trained with
the shape labels).

    python scripts/eval_simclr.py --fit 4000 --test 2000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gencli.data import shapes  # noqa: E402
from gencli.pipelines.vision.embed import load_image_embedder  # noqa: E402
from gencli.weights import weights_dir  # noqa: E402

TASKS = {
    "shape": (lambda s: shapes.SHAPES.index(s.main.shape), len(shapes.SHAPES)),
    "colour": (lambda s: list(shapes.COLOURS).index(s.main.colour), len(shapes.COLOURS)),
    "position": (lambda s: shapes.POSITIONS.index(s.main.position), len(shapes.POSITIONS)),
    "size": (lambda s: list(shapes.SIZES).index(s.main.size), len(shapes.SIZES)),
    "background": (lambda s: list(shapes.BACKGROUNDS).index(s.background), len(shapes.BACKGROUNDS)),
}
FIT_OFFSET = 900_000_000  # train-split seeds no training run reaches
# what tests/test_simclr_quality.py holds weights/simclr-shapes to (800 fitted, 400 held-out scenes);
# measured there: shape 0.593, colour 0.710, position 0.993, size 0.830 (linear), shape 0.205 (k-NN)
FLOORS = {("shape", "linear"): 0.5, ("colour", "linear"): 0.6, ("position", "linear"): 0.9, ("size", "linear"): 0.75, ("shape", "knn"): 0.17}


def scenes(split: str, n: int, offset: int = 0, size: int = 64) -> tuple[list[Image.Image], dict[str, np.ndarray]]:
    images, scene_list = shapes.render_batch(shapes.split_seeds(split, n, offset), size, n_objects=1)
    labels = {task: np.array([f(s) for s in scene_list]) for task, (f, _n) in TASKS.items()}
    return [Image.fromarray(im) for im in images], labels


def features(embedder, images: list[Image.Image], batch: int = 256) -> torch.Tensor:
    return torch.cat([embedder.embed(images[i : i + batch]) for i in range(0, len(images), batch)]).float()


def linear_probe(x_fit: torch.Tensor, y_fit: np.ndarray, x_test: torch.Tensor, y_test: np.ndarray, classes: int, l2: float = 1e-3) -> float:
    """Held-out accuracy of a multinomial logistic regression on standardised features."""
    mean, std = x_fit.mean(0), x_fit.std(0).clamp_min(1e-6)
    a, b = (x_fit - mean) / std, (x_test - mean) / std
    y = torch.from_numpy(y_fit).long()
    w = torch.zeros(a.shape[1], classes, requires_grad=True)
    bias = torch.zeros(classes, requires_grad=True)
    opt = torch.optim.LBFGS([w, bias], lr=1.0, max_iter=300, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(a @ w + bias, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        pred = (b @ w + bias).argmax(1).numpy()
    return float((pred == y_test).mean())


def knn(x_fit: torch.Tensor, y_fit: np.ndarray, x_test: torch.Tensor, y_test: np.ndarray, classes: int, k: int = 20, t: float = 0.07) -> float:
    """Held-out accuracy of a cosine k-NN vote weighted by exp(cosine / t)."""
    a, b = F.normalize(x_fit, dim=1), F.normalize(x_test, dim=1)
    sims = b @ a.t()
    top, idx = sims.topk(k, dim=1)
    votes = torch.zeros(len(b), classes)
    votes.scatter_add_(1, torch.from_numpy(y_fit)[idx].long(), (top / t).exp())
    return float((votes.argmax(1).numpy() == y_test).mean())


def random_encoder(folder: Path, like: Path) -> Path:
    """The architecture of the encoder in ``like`` with the training run's initial weights (seed 0), as a model folder."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_simclr import export

    from gencli.io import read_json
    from gencli.models.simclr import SimCLRConfig, SimCLREncoder

    cfg = SimCLRConfig.from_dict(read_json(like / "config.json"))
    enc = SimCLREncoder(cfg)
    enc.init_weights(torch.Generator().manual_seed(0))
    export(enc.eval(), folder, {"format": "pt", "trained_steps": 0})
    return folder


def evaluate(
    model_paths: dict[str, Path], n_fit: int, n_test: int, k: int = 20, test_offset: int = 0, quiet: bool = False
) -> dict[str, dict[str, dict[str, float]]]:
    """``{model: {task: {"linear": acc, "knn": acc}}}`` on held-out scenes."""
    fit_images, fit_labels = scenes("train", n_fit, FIT_OFFSET)
    test_images, test_labels = scenes("test", n_test, test_offset)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, path in model_paths.items():
        emb = load_image_embedder(path, normalize=False, device="cpu", dtype="float32", threads=torch.get_num_threads())
        xf, xt = features(emb, fit_images), features(emb, test_images)
        out[name] = {}
        for task, (_f, classes) in TASKS.items():
            out[name][task] = {
                "linear": linear_probe(xf, fit_labels[task], xt, test_labels[task], classes),
                "knn": knn(xf, fit_labels[task], xt, test_labels[task], classes, k),
            }
        if not quiet:
            print(f"{name}: {xf.shape[1]}-d features done", file=sys.stderr, flush=True)
    return out


def table(results: dict[str, dict[str, dict[str, float]]], n_test: int) -> str:
    tasks = list(TASKS)
    head = "| encoder | " + " | ".join(f"{t} lin / k-NN" for t in tasks) + " |"
    rule = "|---|" + "---|" * len(tasks)
    rows = [f"| {name} | " + " | ".join(f"{r[t]['linear']:.3f} / {r[t]['knn']:.3f}" for t in tasks) + " |" for name, r in results.items()]
    chance = "| chance | " + " | ".join(f"{1 / TASKS[t][1]:.3f}" for t in tasks) + " |"
    return "\n".join([head, rule, *rows, chance, "", f"({n_test} held-out single-object test-split scenes, 64x64)"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fit", type=int, default=4000, help="labelled train-split scenes the probes are fitted on")
    p.add_argument("--test", type=int, default=2000, help="held-out test-split scenes")
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--models", default="simclr,random,vit")
    p.add_argument("--simclr", type=Path, default=weights_dir() / "simclr-shapes")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"simclr": args.simclr, "random": Path(tmp) / "random", "vit": weights_dir() / "vit-shapes"}
        wanted = args.models.split(",")
        if "random" in wanted:
            random_encoder(paths["random"], args.simclr)
        results = evaluate({m: paths[m] for m in wanted}, args.fit, args.test, args.k)
    print(table(results, args.test))


if __name__ == "__main__":
    main()
