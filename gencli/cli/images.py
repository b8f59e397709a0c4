"""The output of the image commands (``classify``, ``zeroshot``, ``similarity``): JSON lines as the
results come, tables and CSV, and the per-file error lines. No torch at import time."""

from __future__ import annotations

import sys
from typing import IO, Any, Iterable, Optional, Sequence

from gencli.console import Reporter, csv_line, emit_json, json_line, print_table


def write_predictions(results: Iterable[Any], total: int, report: Reporter, description: str) -> int:
    """Write ``classify``/``zeroshot`` results (:class:`~gencli.pipelines.images.ImageResult` whose
    value is a list of predictions): with ``--json`` one line per image in input order,
    ``{"image", "predictions"}`` or ``{"image", "error"}``; otherwise a table after all images.
    Unreadable files are also reported on stderr as they come. Returns the number of images
    predicted; raises the command's UserError (exit 2) at the end if any input failed."""
    from gencli.pipelines.images import unreadable_inputs_error

    rows: list[tuple[str, list[dict[str, Any]]]] = []
    failed: list[str] = []
    with report.progress(description, total=total) as advance:
        for r in results:
            if r.error is not None:
                failed.append(r.path)
                report.error(f"'{r.path}': {r.error}")
                if report.json:
                    emit_json({"image": r.path, "error": r.error})
            elif report.json:
                emit_json({"image": r.path, "predictions": r.value})
            else:
                rows.append((r.path, r.value))
            advance(1)
    if not report.json and rows:
        print_table(predictions_table(rows))
    if failed:
        raise unreadable_inputs_error(failed, total)
    return total - len(failed)


def predictions_table(rows: Sequence[tuple[str, list[dict[str, Any]]]]):
    """One row per prediction, the image named on its first row."""
    from rich.table import Table

    keys = [k for k in ("label", "id", "score") if any(k in p for _, preds in rows for p in preds)]
    table = Table(box=None, header_style="bold", show_edge=False, pad_edge=False)
    table.add_column("image", overflow="fold")
    table.add_column("rank", justify="right")
    for k in keys:
        table.add_column(k, justify="right" if k in ("id", "score") else "left")
    for path, preds in rows:
        for rank, p in enumerate(preds, 1):
            cells = [path if rank == 1 else "", str(rank)]
            for k in keys:
                v = p.get(k)
                cells.append(f"{v:.4f}" if isinstance(v, float) else ("" if v is None else str(v)))
            table.add_row(*cells, end_section=rank == len(preds) and len(preds) > 1)
    return table


def write_similarities(results: Iterable[Any], total: int, texts: Sequence[str], report: Reporter, fmt: str, file: Optional[IO[str]] = None) -> list[str]:
    """Write ``similarity`` results (an :class:`~gencli.pipelines.images.ImageResult` per image whose
    value is its cosine per text) as CSV rows or JSON lines as they come, or a table at the end
    (``fmt``), to ``file`` (default: stdout). Unreadable files are reported on stderr (and as JSON
    error lines). Returns the paths that could not be read."""
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
                    emit(json_line({"image": r.path, "error": r.error}))
            else:
                rows.append((r.path, r.value))
                if fmt == "json":
                    emit(json_line({"image": r.path, "similarities": [{"text": t, "cosine": v} for t, v in zip(texts, r.value)]}))
                elif fmt == "csv":
                    emit(csv_line([r.path, *(f"{v:.6f}" for v in r.value)]))
            advance(1)
    if fmt == "table" and rows:
        print_table(similarity_table(rows, texts), file)
    return failed


def similarity_table(rows: Sequence[tuple[str, list[float]]], texts: Sequence[str]):
    """One row per image, one column per text, each row's best text in bold."""
    from rich.table import Table

    table = Table(box=None, header_style="bold", show_edge=False, pad_edge=False)
    table.add_column("image", overflow="fold")
    for t in texts:
        table.add_column(t, justify="right", overflow="fold")
    for path, values in rows:
        best = max(range(len(values)), key=values.__getitem__)
        table.add_row(path, *[f"[bold]{v:.4f}[/bold]" if i == best else f"{v:.4f}" for i, v in enumerate(values)])
    return table

