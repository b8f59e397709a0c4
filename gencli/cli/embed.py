"""`gencli embed TEXT...`: sentence embeddings from a BERT-family encoder (sentence-transformers folders too)."""

from __future__ import annotations

import enum
from typing import Annotated, Optional

import typer

from gencli.cli import app
from gencli.cli.common import DETERMINISTIC_SEED_HELP, RunOptions, command, option

DEFAULT_MODEL = "bert-pystdlib"  # the embedded default (mean pooling)


class Pooling(str, enum.Enum):
    mean = "mean"
    cls = "cls"
    max = "max"


def read_texts(texts: Optional[list[str]], texts_file: Optional[str]) -> list[str]:
    """The positional texts (``-`` = one text a line from stdin) and the lines of ``--texts-file``."""
    from pathlib import Path

    from gencli.errors import UserError
    from gencli.io import read_stdin_lines

    out: list[str] = []
    stdin_used = False
    for t in texts or []:
        if t == "-":
            if stdin_used:
                raise UserError("stdin ('-') can be read only once")
            stdin_used = True
            out.extend(read_stdin_lines())
        else:
            out.append(t)
    if texts_file is not None:
        if texts_file == "-":
            if stdin_used:
                raise UserError("stdin ('-') can be read only once")
            out.extend(read_stdin_lines())
        else:
            p = Path(texts_file)
            if not p.is_file():
                raise UserError(f"--texts-file '{texts_file}' does not exist")
            out.extend(line.strip() for line in p.read_text(encoding="utf-8").splitlines() if line.strip())
    if not out:
        raise UserError("no text given: pass texts as arguments, '-' for one text a line on stdin, or --texts-file")
    return out


TextsArg = Annotated[Optional[list[str]], typer.Argument(metavar="[TEXT]...", help="Texts, or - for one text a line on stdin.", show_default=False)]
TextsFileOpt = Annotated[Optional[str], option("--texts-file", help="A file with one text a line (- = stdin).")]
MaxLengthOpt = Annotated[
    Optional[int], option("--max-length", help="At most this many tokens per text (default: the model's window); longer texts are truncated with a warning.")
]


@command(app, "embed", seed_help=DETERMINISTIC_SEED_HELP)
def embed(
    texts: TextsArg = None,
    texts_file: TextsFileOpt = None,
    pooling: Annotated[Optional[Pooling], option("--pooling", help="Override the model's pooling of token states.")] = None,
    normalize: Annotated[Optional[bool], option("--normalize/--no-normalize", help="L2-normalise the vectors (default: as the model's folder says).")] = None,
    max_length: MaxLengthOpt = None,
    batch_size: Annotated[int, option("--batch-size", help="Texts per forward pass (batched by length; results stay in input order).")] = 32,
    out: Annotated[
        Optional[str], option("--out", metavar="FILE", help="Write the matrix to FILE.npy, FILE.safetensors (tensor 'embeddings') or FILE.jsonl.")
    ] = None,
    force: Annotated[bool, option("--force", help="Overwrite an existing --out file.")] = False,
    *,
    opts: RunOptions,
) -> None:
    """Sentence embeddings from a BERT, RoBERTa or DistilBERT checkpoint (sentence-transformers folders: their pooling, normalisation and window).

    With --json one line per text: {"text", "embedding": [...]} in input order; --out writes the matrix
    (rows in input order). Otherwise one line per text: its dimension, norm and first values. Without
    --model: bert-pystdlib's mean-pooled token states (a small encoder pretrained on the standard
    library's docstrings and comments, not trained for sentence similarity).
    """
    from gencli.weights import resolve_model

    text_list = read_texts(texts, texts_file)
    if out is not None:
        from gencli.io import ensure_writable
        from gencli.pipelines.encoders.outputs import check_matrix_path

        check_matrix_path(out)
        ensure_writable(out, force)
    from gencli.console import emit_json
    from gencli.pipelines.encoders.embed import embed_texts
    from gencli.pipelines.encoders.loading import load_encoder

    report = opts.report
    enc = load_encoder(resolve_model(opts.model, DEFAULT_MODEL), task="base", **opts.load_options())
    report.debug(f"embed: {enc.describe()}; pooling {enc.layout.pooling}, normalize {enc.layout.normalize}")
    vectors = embed_texts(
        enc,
        text_list,
        pooling=pooling.value if pooling is not None else None,
        normalize=normalize,
        max_length=max_length,
        batch_size=batch_size,
        warn=report.warn,
    )
    if out is not None:
        from gencli.pipelines.encoders.outputs import write_matrix

        write_matrix(out, vectors, text_list, force=force)
        report.log(f"wrote {vectors.shape[0]} x {vectors.shape[1]} embeddings to {out}")
        if not report.json:
            return
    for text, vec in zip(text_list, vectors.tolist()):
        if report.json:
            emit_json({"text": text, "embedding": vec})
        else:
            norm = sum(v * v for v in vec) ** 0.5
            head = " ".join(f"{v:+.4f}" for v in vec[:6])
            typer.echo(f"{len(vec)}-d  norm {norm:.4f}  [{head} ...]  {text}")
