"""`gencli similarity`: the image-text cosine similarity matrix of a CLIP model, as a table, CSV or
JSON lines. The text embeddings are computed once; images are read and encoded in batches, and an
unreadable image is reported and skipped (exit code 2 at the end)."""

from __future__ import annotations

import csv
import io
import json
import sys
from typing import Any, Optional, Sequence

from gencli.errors import UserError
from gencli.pipelines.clip import ClipBundle
from gencli.pipelines.images import iter_image_batches
from gencli.pipelines.zeroshot import read_lines, similarity_matrix


def parse_texts(texts: Optional[Sequence[str]], texts_file: Optional[str]) -> list[str]:
    """Texts from repeated ``--texts`` and/or ``--texts-file`` (one per line, ``-`` = stdin), blanks dropped."""
    out = [t.strip() for t in (texts or []) if t.strip()]
    if texts_file:
        out.extend(read_lines(texts_file, "--texts-file"))
    if not out:
        raise UserError('no texts: give --texts "a red star" (repeatable) or --texts-file FILE')
    return out


def _table(rows: list[tuple[str, list[float]]], texts: Sequence[str]):
    """A rich table: one row per image, one column per text, each row's best text in bold."""
    from rich.table import Table

    table = Table(box=None, header_style="bold", show_edge=False, pad_edge=False)
    table.add_column("image", overflow="fold")
    for t in texts:
        table.add_column(t, justify="right", overflow="fold")
    for path, values in rows:
        best = max(range(len(values)), key=values.__getitem__)
        table.add_row(path, *[f"[bold]{v:.4f}[/bold]" if i == best else f"{v:.4f}" for i, v in enumerate(values)])
    return table


def _render(table, file=None) -> None:
    from rich.console import Console

    if file is None:
        Console(highlight=False, soft_wrap=True).print(table)
    else:  # plain text, wide enough not to wrap the columns
        Console(file=file, highlight=False, width=100_000, color_system=None, soft_wrap=True).print(table, crop=False)


def run(
    bundle: ClipBundle,
    paths: Sequence[str],
    texts: Sequence[str],
    opts: Any,
    *,
    fmt: str = "table",
    out: Optional[str] = None,
    force: bool = False,
    batch_size: int = 32,
) -> list[tuple[str, list[float]]]:
    """Compute and write the matrix (``fmt``: table, csv or json); returns the rows ``(image, cosines)``."""
    from gencli.cli.common import stderr
    from gencli.io import atomic_open

    text_emb = bundle.encode_texts(list(texts))
    rows: list[tuple[str, list[float]]] = []
    lines: list[str] = []  # JSON lines / CSV rows, for --out
    failed: list[str] = []
    stream = out is None and fmt in ("json", "csv")
    csv_buf = io.StringIO()
    writer = csv.writer(csv_buf, lineterminator="\n")

    def emit(line: str) -> None:
        if stream:
            sys.stdout.write(line)
            sys.stdout.flush()
        else:
            lines.append(line)

    def csv_line(values: Sequence[Any]) -> str:
        csv_buf.seek(0)
        csv_buf.truncate()
        writer.writerow(values)
        return csv_buf.getvalue()

    if fmt == "csv":
        emit(csv_line(["image", *texts]))
    with opts.progress("similarity", total=len(paths)) as advance:
        for batch in iter_image_batches(paths, batch_size):
            good = [it for it in batch if it.image is not None]
            sims = iter(similarity_matrix(bundle, [it.image for it in good], text_emb).tolist() if good else [])
            for it in batch:
                if it.error is not None:
                    failed.append(it.path)
                    stderr.print(f"error: '{it.path}': {it.error}", markup=False, style="red")
                    if fmt == "json":
                        emit(json.dumps({"image": it.path, "error": it.error}, ensure_ascii=False) + "\n")
                    continue
                values = [round(v, 6) for v in next(sims)]
                rows.append((it.path, values))
                if fmt == "json":
                    record = {"image": it.path, "similarities": [{"text": t, "cosine": v} for t, v in zip(texts, values)]}
                    emit(json.dumps(record, ensure_ascii=False) + "\n")
                elif fmt == "csv":
                    emit(csv_line([it.path, *(f"{v:.6f}" for v in values)]))
            advance(len(batch))
    if out is not None:
        with atomic_open(out, "w", force=force, encoding="utf-8", newline="") as fh:
            if fmt == "table":
                if rows:
                    _render(_table(rows, texts), fh)
            else:
                fh.write("".join(lines))
    elif fmt == "table" and rows:
        _render(_table(rows, texts))
    if failed:
        raise UserError(f"{len(failed)} of {len(paths)} input(s) could not be read" + (f" (first: '{failed[0]}')" if len(failed) > 1 else ""))
    return rows


__all__ = ["parse_texts", "run"]
