"""The output of the image commands (``classify``, ``zeroshot``, ``similarity``): JSON lines as the
results come, tables and CSV, and the per-file error lines. No torch at import time."""

from __future__ import annotations

import sys
from typing import IO, Annotated, Any, Iterable, Optional, Sequence

import typer

from gencli.cli.common import at_least, option
from gencli.console import Reporter, csv_line, emit_json, is_terminal, json_line, print_table

# the options the image commands share (each command gives its own default)
IMAGES_HELP = "Image files, directories of images, or - to read one path per line from stdin."
ImagesArg = Annotated[list[str], typer.Argument(metavar="IMAGE...", help=IMAGES_HELP, show_default=False)]
TopKOpt = Annotated[int, option("--top-k", callback=at_least(1), help="Predictions shown per image.")]
BatchSizeOpt = Annotated[int, option("--batch-size", callback=at_least(1), help="Images per forward pass.")]
RecursiveOpt = Annotated[bool, option("--recursive", help="Descend into sub-directories of directory inputs.")]


def output_format(report: Reporter, csv: bool) -> str:
    """The results' format from ``--json``/``--csv`` (exclusive): "json", "csv" or "table"."""
    from gencli.errors import UserError

    if csv and report.json:
        raise UserError("--csv and --json are exclusive: choose one output format")
    return "json" if report.json else "csv" if csv else "table"


def write_predictions(results: Iterable[Any], total: int, report: Reporter, description: str, fmt: str = "table", file: Optional[IO[str]] = None) -> int:
    """Write ``classify``/``zeroshot`` results (:class:`~gencli.pipelines.vision.images.ImageResult` whose
    value is a list of predictions) to ``file`` (default: stdout), in input order: JSON lines
    ``{"image", "predictions"}`` or ``{"image", "error"}`` and CSV rows ``image,rank,label,...`` as
    they come, or a table after all images (``fmt``). Unreadable files are also reported on stderr
    as they come. Returns the number of images predicted; raises the command's UserError (exit 2)
    at the end if any input failed."""
    from gencli.pipelines.vision.images import result_record, unreadable_inputs_error

    rows: list[tuple[str, list[dict[str, Any]]]] = []
    failed: list[str] = []
    out = sys.stdout if file is None else file
    wrote_header = False
    with report.progress(description, total=total) as advance:
        for r in results:
            if r.error is not None:
                failed.append(r.path)
                report.error(f"'{r.path}': {r.error}")
                if fmt == "json":
                    emit_json(result_record(r), out)
            elif fmt == "json":
                emit_json(result_record(r), out)
            elif fmt == "csv":
                keys = prediction_keys([(r.path, r.value)])
                if not wrote_header:
                    out.write(csv_line(["image", "rank", *keys]))
                    wrote_header = True
                out.write("".join(csv_line(cells) for cells in prediction_rows(r.path, r.value, keys, repeat_image=True)))
                out.flush()
            else:
                rows.append((r.path, r.value))
            advance(1)
    if fmt == "table" and rows:
        print_table(predictions_table(rows, repeat_image=not is_terminal(out)), out)
    if failed:
        raise unreadable_inputs_error(failed, total)
    return total - len(failed)


def ray_image_results(paths: Sequence[str], load: Any, distributed: Any, opts: Any, *, batch_size: int, record: Any = None) -> Optional[Iterable[Any]]:
    """``--ray``: the results of ``load()``'s predict per image from Ray replicas, in input order, for
    the command's writer; None with ``--out-dir`` (the replicas wrote ``record(result)`` JSON-lines
    shards, and the unreadable inputs are reported here: exit 2 if any)."""
    from gencli.pipelines.vision.ray import predict_images

    more = {"record": record} if record is not None else {}
    results = predict_images(paths, load, distributed, opts.report, batch_size=batch_size, device=opts.device, out=opts.out, **more)
    if distributed.out_dir is None:
        return results
    report_sharded(results, len(paths), opts.report, distributed.out_dir)
    return None


def report_sharded(results: Iterable[Any], total: int, report: Reporter, out_dir: str) -> int:
    """``--out-dir``: the replicas wrote the results; report the unreadable inputs (exit 2 if any) and
    the count. Returns the number of images predicted."""
    from gencli.pipelines.vision.images import unreadable_inputs_error

    failed = []
    for r in results:
        if r.error is not None:
            failed.append(r.path)
            report.error(f"'{r.path}': {r.error}")
    report.log(f"{total - len(failed)} image(s) -> shards in {out_dir}")
    if failed:
        raise unreadable_inputs_error(failed, total)
    return total - len(failed)


def prediction_keys(rows: Sequence[tuple[str, list[dict[str, Any]]]]) -> list[str]:
    """The prediction fields present (classify has label/id/score, zeroshot label/score)."""
    return [k for k in ("label", "id", "score") if any(k in p for _, preds in rows for p in preds)]


def prediction_rows(path: str, preds: list[dict[str, Any]], keys: Sequence[str], repeat_image: bool) -> list[list[str]]:
    """The rows of one image's predictions: image (on every row, or the first only), rank, fields."""
    out = []
    for rank, p in enumerate(preds, 1):
        cells = [path if rank == 1 or repeat_image else "", str(rank)]
        for k in keys:
            v = p.get(k)
            cells.append(f"{v:.4f}" if isinstance(v, float) else ("" if v is None else str(v)))
        out.append(cells)
    return out


def predictions_table(rows: Sequence[tuple[str, list[dict[str, Any]]]], repeat_image: bool = False):
    """One row per prediction, the image named on its first row (on every row with
    ``repeat_image``: the plain rows a pipe gets, so grep and sort keep whole records)."""
    from rich.table import Table
    from rich.text import Text

    keys = prediction_keys(rows)
    table = Table(box=None, header_style="bold", show_edge=False, pad_edge=False)
    table.add_column("image", overflow="fold")
    table.add_column("rank", justify="right")
    for k in keys:
        table.add_column(k, justify="right" if k in ("id", "score") else "left")
    for path, preds in rows:
        cells = prediction_rows(path, preds, keys, repeat_image)
        for i, row in enumerate(cells):
            # plain text: a name or label with [brackets] is not rich markup
            table.add_row(*(Text(c) for c in row), end_section=not repeat_image and i == len(cells) - 1 and len(cells) > 1)
    return table


def write_similarities(results: Iterable[Any], total: int, texts: Sequence[str], report: Reporter, fmt: str, file: Optional[IO[str]] = None) -> list[str]:
    """Write ``similarity`` results (an :class:`~gencli.pipelines.vision.images.ImageResult` per image whose
    value is its cosine per text) as CSV rows or JSON lines as they come, or a table at the end
    (``fmt``), to ``file`` (default: stdout). Unreadable files are reported on stderr (and as JSON
    error lines). Returns the paths that could not be read."""
    from gencli.pipelines.clip.similarity import similarity_record

    rows: list[tuple[str, list[float]]] = []
    failed: list[str] = []
    out = sys.stdout if file is None else file

    def emit(line: str) -> None:
        out.write(line)
        out.flush()

    if fmt == "csv":
        emit(csv_line(["image", *texts]))
    with report.progress("similarity", total=total) as advance:
        for r in results:
            if r.error is not None:
                failed.append(r.path)
                report.error(f"'{r.path}': {r.error}")
                if fmt == "json":
                    emit(json_line(similarity_record(r, texts)))
            else:
                rows.append((r.path, r.value))
                if fmt == "json":
                    emit(json_line(similarity_record(r, texts)))
                elif fmt == "csv":
                    emit(csv_line([r.path, *(f"{v:.6f}" for v in r.value)]))
            advance(1)
    if fmt == "table" and rows:
        print_table(similarity_table(rows, texts), file)
    return failed


def similarity_table(rows: Sequence[tuple[str, list[float]]], texts: Sequence[str]):
    """One row per image, one column per text, each row's best text in bold."""
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, header_style="bold", show_edge=False, pad_edge=False)
    table.add_column("image", overflow="fold")
    for t in texts:
        table.add_column(Text(t), justify="right", overflow="fold")  # plain text: [brackets] are not markup
    for path, values in rows:
        best = max(range(len(values)), key=values.__getitem__)
        table.add_row(Text(path), *[f"[bold]{v:.4f}[/bold]" if i == best else f"{v:.4f}" for i, v in enumerate(values)])
    return table

