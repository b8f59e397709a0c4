"""`gencli classify IMAGE...`: image classification with ViT / DeiT checkpoints."""

from __future__ import annotations

from typing import Annotated

import typer

from gencli.cli import app
from gencli.cli.common import DETERMINISTIC_SEED_HELP, GpusPerReplica, OutDir, RayAddress, Replicas, RunOptions, at_least, command, option, ray_options


@command(app, "classify", seed_help=DETERMINISTIC_SEED_HELP)
def classify(
    images: Annotated[
        list[str],
        typer.Argument(metavar="IMAGE...", help="Image files, directories of images, or - to read one path per line from stdin.", show_default=False),
    ],
    top_k: Annotated[int, option("--top-k", callback=at_least(1), help="Predictions shown per image.")] = 5,
    batch_size: Annotated[int, option("--batch-size", callback=at_least(1), help="Images per forward pass.")] = 16,
    recursive: Annotated[bool, option("--recursive", help="Descend into sub-directories of directory inputs.")] = False,
    csv: Annotated[bool, option("--csv", help="CSV rows image,rank,label,id,score instead of a table.")] = False,
    ray: RayAddress = None,
    replicas: Replicas = None,
    gpus_per_replica: GpusPerReplica = None,
    out_dir: OutDir = None,
    *,
    opts: RunOptions,
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
    from gencli.pipelines.classify import DEFAULT_MODEL, ImageClassifier
    from gencli.pipelines.images import image_paths, predict_image_files
    from gencli.weights import resolve_model

    report = opts.report
    fmt = output_format(report, csv)
    paths = image_paths(images, recursive=recursive)  # bad inputs fail before the model loads
    distributed = ray_options(ray, replicas, gpus_per_replica, out_dir, opts.force)
    if distributed is not None:
        from gencli.cli.images import ray_image_results
        from gencli.pipelines.distributed.images import classifier

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
