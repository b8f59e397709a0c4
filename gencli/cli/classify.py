"""`gencli classify IMAGE...`: image classification with ViT / DeiT checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

from gencli.cli import app
from gencli.cli.common import DETERMINISTIC_SEED_HELP, RunOptions, command, option
from gencli.cli.images import BatchSizeOpt, ImagesArg, RecursiveOpt, TopKOpt

if TYPE_CHECKING:
    from gencli.pipelines.distributed.runtime import RayOptions


@command(app, "classify", ray=True, seed_help=DETERMINISTIC_SEED_HELP)
def classify(
    images: ImagesArg,
    top_k: TopKOpt = 5,
    batch_size: BatchSizeOpt = 16,
    recursive: RecursiveOpt = False,
    csv: Annotated[bool, option("--csv", help="CSV rows image,rank,label,id,score instead of a table.")] = False,
    *,
    opts: RunOptions,
    distributed: Optional[RayOptions],
) -> None:
    """Classify images with a ViT or DeiT checkpoint (default: the embedded shapes classifier).

    Prints a table (plain whole rows when stdout is not a terminal), CSV with --csv, or with --json one
    line per image: {"image", "predictions": [{"label", "id", "score"}]}; --out FILE writes them there.
    Unreadable images are reported and skipped; the exit code is then 2. --ray classifies on Ray Data
    with the same output in the same order (--out-dir: JSON-lines shards written by the replicas).
    """
    import functools
    import time

    from gencli.cli.images import output_format, write_predictions
    from gencli.pipelines.vision.classify import DEFAULT_MODEL, ImageClassifier
    from gencli.pipelines.vision.images import image_paths, predict_image_files
    from gencli.weights import resolve_model

    report = opts.report
    fmt = output_format(report, csv)
    paths = image_paths(images, recursive=recursive)  # bad inputs fail before the model loads
    if distributed is not None:
        from gencli.cli.images import ray_image_results
        from gencli.pipelines.vision.ray import classifier

        load = functools.partial(classifier, resolve_model(opts.model, DEFAULT_MODEL), top_k, **opts.load_options())
        results = ray_image_results(paths, load, distributed, opts, batch_size=batch_size)
        if results is not None:
            with opts.results(newline="") as out:
                write_predictions(results, len(paths), report, "classifying", fmt, out)
        return
    start = time.perf_counter()
    clf = ImageClassifier.load(resolve_model(opts.model, DEFAULT_MODEL), warn=report.warn, **opts.load_options())
    loaded = time.perf_counter()
    report.debug(f"classify: {clf.placement.describe()}")
    report.debug(f"loaded {clf.path} ({clf.config.model_type}, {clf.config.num_labels} labels) in {loaded - start:.2f}s")
    results = predict_image_files(paths, lambda ims: clf.predict(ims, top_k), batch_size=batch_size)
    with opts.results(newline="") as out:
        n = write_predictions(results, len(paths), report, "classifying", fmt, out)
    took = time.perf_counter() - loaded
    report.debug(f"{n} image(s) in {took:.2f}s ({n / took:.1f} images/s)" if took > 0 else f"{n} image(s)")
