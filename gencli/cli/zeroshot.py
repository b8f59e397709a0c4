"""`gencli zeroshot IMAGE... --labels a,b,c` and `gencli similarity --images ... --texts ...` (CLIP)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from gencli.cli import app
from gencli.cli.common import DETERMINISTIC_SEED_HELP, RunOptions, command, option
from gencli.cli.images import IMAGES_HELP, BatchSizeOpt, ImagesArg, RecursiveOpt, TopKOpt

if TYPE_CHECKING:
    from gencli.pipelines.distributed.runtime import RayOptions


@command(app, "zeroshot", ray=True, seed_help=DETERMINISTIC_SEED_HELP)
def zeroshot(
    images: ImagesArg,
    labels: Annotated[
        Optional[list[str]], option("--labels", help='Comma-separated candidate labels, e.g. "cat,dog,bird" (repeatable: -l cat -l dog).')
    ] = None,
    labels_file: Annotated[Optional[str], typer.Option("--labels-file", help="A file with one label per line (- = stdin).")] = None,
    template: Annotated[
        Optional[list[str]],
        option(
            "--template",
            help="Prompt with {} for the label; repeat it to average several prompts (prompt ensembling). "
            'Default: the model\'s zeroshot_templates.json if it has one, else "a photo of a {}."',
        ),
    ] = None,
    top_k: TopKOpt = 5,
    batch_size: BatchSizeOpt = 32,
    recursive: RecursiveOpt = False,
    csv: Annotated[bool, option("--csv", help="CSV rows image,rank,label,score instead of a table.")] = False,
    *,
    opts: RunOptions,
    distributed: Optional[RayOptions],
) -> None:
    """Zero-shot image classification with CLIP against labels you choose (default: the embedded shapes CLIP).

    Scores are a softmax over logit_scale * cosine similarity between the image and each label's
    prompt. Prints a table (plain whole rows when stdout is not a terminal), CSV with --csv, or with
    --json one line per image: {"image", "predictions": [{"label", "score"}]}; --out FILE writes them there.
    Unreadable images are reported and skipped; the exit code is then 2. --ray scores on Ray Data with
    the same output in the same order (--out-dir: JSON-lines shards written by the replicas).
    """
    import functools
    import time

    from gencli.cli.images import output_format, write_predictions
    from gencli.errors import UserError
    from gencli.pipelines.clip import zeroshot as zs
    from gencli.pipelines.vision.images import image_paths, predict_image_files

    report = opts.report
    fmt = output_format(report, csv)
    if labels_file == "-" and "-" in images:
        raise UserError("stdin cannot hold both the image paths and the labels: give --labels-file a file")
    label_list = zs.parse_labels(",".join(labels) if labels else None, labels_file)
    if len(label_list) == 1:
        report.warn(f"one label ('{label_list[0]}'): every image scores 1.0, since the scores are shared out over the labels; give two or more")
    templates = zs.check_templates(template) if template else None
    paths = image_paths(images, recursive=recursive)  # bad inputs fail before the model loads
    if distributed is not None:
        from gencli.cli.images import ray_image_results
        from gencli.pipelines.vision.ray import zero_shot
        from gencli.weights import resolve_model

        load = functools.partial(zero_shot, resolve_model(opts.model, zs.DEFAULT_MODEL), label_list, templates, top_k, **opts.load_options())
        results = ray_image_results(paths, load, distributed, opts, batch_size=batch_size)
        if results is not None:
            with opts.results(newline="") as out:
                write_predictions(results, len(paths), report, "zero-shot", fmt, out)
        return
    start = time.perf_counter()
    bundle = _load(opts, "zeroshot")
    loaded = time.perf_counter()
    report.debug(f"loaded {bundle.path} in {loaded - start:.2f}s")
    if templates is None:
        templates = zs.default_templates(bundle.path)
        report.debug(f"prompt template(s): {', '.join(repr(t) for t in templates)}")
    clf = zs.ZeroShotClassifier(bundle, label_list, templates, warn=report.warn)
    encoded = time.perf_counter()
    report.debug(f"{len(label_list)} label(s) x {len(templates)} template(s) encoded in {encoded - loaded:.2f}s")
    results = predict_image_files(paths, lambda ims: clf.predict(ims, top_k), batch_size=batch_size)
    with opts.results(newline="") as out:
        n = write_predictions(results, len(paths), report, "zero-shot", fmt, out)
    took = time.perf_counter() - encoded
    report.debug(f"{n} image(s) in {took:.2f}s ({n / took:.1f} images/s)" if took > 0 else f"{n} image(s)")


def _load(opts: RunOptions, command: str):
    """The CLIP model both commands run (``--model``, or the embedded default)."""
    from gencli.pipelines.clip import zeroshot as zs
    from gencli.weights import resolve_model

    path = resolve_model(opts.model, zs.DEFAULT_MODEL)
    bundle = zs.load(path, warn=opts.report.warn, **opts.load_options())
    opts.report.debug(f"{command}: {bundle.placement.describe()}")
    return bundle


@command(app, "similarity", ray=True, seed_help=DETERMINISTIC_SEED_HELP)
def similarity(
    images: Annotated[Optional[list[str]], typer.Argument(metavar="[IMAGE]...", help=IMAGES_HELP + " (also --images)", show_default=False)] = None,
    image_opt: Annotated[Optional[list[str]], option("--images", help="An image, a directory or - (repeatable).", show_default=False)] = None,
    texts: Annotated[
        Optional[list[str]], option("--texts", "--text", help="A text to compare with every image (repeatable).", show_default=False)
    ] = None,
    texts_file: Annotated[Optional[str], typer.Option("--texts-file", help="A file with one text per line (- = stdin).")] = None,
    csv_out: Annotated[bool, option("--csv", help="Write CSV (image, then one column per text) instead of a table.")] = False,
    batch_size: BatchSizeOpt = 32,
    recursive: RecursiveOpt = False,
    *,
    opts: RunOptions,
    distributed: Optional[RayOptions],
) -> None:
    """The image-text cosine similarity matrix of a CLIP model, for retrieval and ranking.

    Rows are images, columns texts. Prints a table (plain whole rows when stdout is not a terminal), CSV
    with --csv, or with --json one line per image: {"image", "similarities": [{"text", "cosine"}]}
    (texts in the order given); --out FILE writes them there. --ray scores on Ray Data with the same
    output in the same order (--out-dir: JSON-lines shards written by the replicas).
    """
    import functools

    from gencli.cli.images import output_format, write_similarities
    from gencli.errors import UserError
    from gencli.pipelines.clip import similarity as sim
    from gencli.pipelines.vision.images import image_paths, predict_image_files, unreadable_inputs_error

    fmt = output_format(opts.report, csv_out)
    inputs = list(images or []) + list(image_opt or [])
    if not inputs:
        raise UserError("no images: give image paths (or --images PATH, a directory, or - for paths on stdin)")
    if texts_file == "-" and "-" in inputs:
        raise UserError("stdin cannot hold both the image paths and the texts: give --texts-file a file")
    text_list = sim.parse_texts(texts, texts_file)
    paths = image_paths(inputs, recursive=recursive)
    if distributed is not None:
        from gencli.cli.images import ray_image_results
        from gencli.pipelines.clip.zeroshot import DEFAULT_MODEL
        from gencli.pipelines.vision.ray import similarity as scorer
        from gencli.weights import resolve_model

        load = functools.partial(scorer, resolve_model(opts.model, DEFAULT_MODEL), text_list, **opts.load_options())
        record = functools.partial(sim.similarity_record, texts=text_list)
        results = ray_image_results(paths, load, distributed, opts, batch_size=batch_size, record=record)
        if results is None:
            return
    else:
        bundle = _load(opts, "similarity")
        results = predict_image_files(paths, sim.SimilarityScorer(bundle, text_list, warn=opts.report.warn), batch_size=batch_size)
    with opts.results(newline="") as out:
        failed = write_similarities(results, len(paths), text_list, opts.report, fmt, out)
    if failed:
        raise unreadable_inputs_error(failed, len(paths))
