"""`gencli embed TEXT...`: sentence embeddings from a BERT-family encoder (sentence-transformers folders too)."""

from __future__ import annotations

import enum
from typing import Annotated, Optional

import typer

from gencli.cli import app
from gencli.cli.common import DETERMINISTIC_SEED_HELP, RunOptions, at_least, command, option

DEFAULT_MODEL = "bert-shapes-embed"  # the embedded text default (a sentence-transformers folder)


class Pooling(str, enum.Enum):
    mean = "mean"
    cls = "cls"
    max = "max"


class MatrixFormat(str, enum.Enum):
    npy = "npy"
    safetensors = "safetensors"
    jsonl = "jsonl"


def read_texts(texts: Optional[list[str]], texts_file: Optional[str], *, keep_tabs: bool = False) -> list[str]:
    """The positional texts (``-`` = one text a line from stdin) and the lines of ``--texts-file``
    (stripped; their tabs kept with ``keep_tabs``: classify-text's text/pair separator)."""
    from gencli.errors import UserError
    from gencli.io import check_text, read_lines, read_stdin_lines, strip_line

    out: list[str] = []
    stdin_used = False
    for i, t in enumerate(texts or []):
        if t == "-":
            if stdin_used:
                raise UserError("stdin ('-') can be read only once")
            stdin_used = True
            out.extend(read_stdin_lines(keep_tabs=keep_tabs))
        else:
            out.append(check_text(t, f"text {i + 1}"))
    if texts_file is not None:
        if texts_file == "-" and stdin_used:
            raise UserError("stdin ('-') can be read only once")
        out.extend(strip_line(line, keep_tabs=keep_tabs) for line in read_lines(texts_file, what="--texts-file")[0] if line.strip())
    if not out:
        raise UserError("no text given: pass texts as arguments, '-' for one text a line on stdin, or --texts-file")
    return out


TextsArg = Annotated[Optional[list[str]], typer.Argument(metavar="[TEXT]...", help="Texts, or - for one text a line on stdin.", show_default=False)]
TextsFileOpt = Annotated[Optional[str], option("--texts-file", help="A file with one text a line (- = stdin).")]
MaxLengthOpt = Annotated[
    Optional[int], option("--max-length", help="At most this many tokens per text (default: the model's window); longer texts are truncated with a warning.")
]


ImagesFlag = Annotated[
    bool, option("--images", help="The inputs are images (files, directories, or - for paths on stdin): embed them with a CLIP, ViT or SimCLR model.")
]
QueryOpt = Annotated[
    Optional[list[str]],
    option("--query", metavar="IMAGE", help="With --images: list the -k inputs most cosine-similar to this image (repeatable).", show_default=False),
]


InputsArg = Annotated[
    Optional[list[str]],
    typer.Argument(
        metavar="[TEXT|IMAGE]...", help="Texts (- = one a line on stdin); with --images image files, directories, or - for paths on stdin.", show_default=False
    ),
]


@command(app, "embed", seed_help=DETERMINISTIC_SEED_HELP)
def embed(
    texts: InputsArg = None,
    texts_file: TextsFileOpt = None,
    images: ImagesFlag = False,
    query: QueryOpt = None,
    top_k: Annotated[Optional[int], option("--top-k", callback=at_least(1), help="With --query: neighbours listed per query (default 5).")] = None,
    recursive: Annotated[bool, option("--recursive", help="With --images: descend into sub-directories of directory inputs.")] = False,
    pooling: Annotated[Optional[Pooling], option("--pooling", help="Override the model's pooling of token states.")] = None,
    normalize: Annotated[
        Optional[bool],
        option("--normalize/--no-normalize", help="L2-normalise the vectors (default: as the model's folder says; CLIP: yes; ViT, SimCLR: no)."),
    ] = None,
    max_length: MaxLengthOpt = None,
    batch_size: Annotated[
        int, option("--batch-size", callback=at_least(1), help="Texts (or images) per forward pass (texts batched by length; results stay in input order).")
    ] = 32,
    out: Annotated[
        Optional[str],
        option("--out", metavar="FILE", help="Write the matrix to FILE.npy, FILE.safetensors (tensor 'embeddings') or FILE.jsonl; - = stdout (see --format)."),
    ] = None,
    fmt: Annotated[
        Optional[MatrixFormat],
        option("--format", help="The matrix format where --out's name does not say it: -, a pipe or a device (default: jsonl).", show_default=False),
    ] = None,
    force: Annotated[bool, option("--force", help="Overwrite an existing --out file.")] = False,
    *,
    opts: RunOptions,
) -> None:
    """Embeddings of texts (BERT, RoBERTa, DistilBERT, sentence-transformers and CLIP checkpoints) or, with --images, of images (CLIP, ViT, SimCLR).

    With --json one line per input: {"text", "embedding": [...]} (or {"image", "embedding"}) in input
    order; --out writes the matrix (rows in input order). Otherwise one line per input: its dimension,
    norm and first values. Texts: pooling, normalisation and window from the model's files; on a CLIP
    checkpoint the text tower's projected, L2-normalised embedding, comparable by dot product with
    the same model's image embeddings. Images: CLIP -> the image tower's projected, L2-normalised
    embedding; ViT/DeiT -> the [CLS] token's final hidden state; SimCLR -> the encoder's pooled
    representation. Without --model: bert-shapes-embed for texts (a small sentence embedding trained
    contrastively on shapes-world captions: it knows that world's words and little else),
    simclr-shapes for images (trained without labels on shapes-world scenes).
    --query IMAGE lists the inputs nearest to the image by cosine similarity (JSON: {"query",
    "neighbours": [{"rank", "image", "cosine"}]}). Unreadable images are reported, the others go on,
    and the exit code is then 2.
    """
    from gencli.errors import UserError

    matrix = _plan_matrix(out, fmt.value if fmt is not None else None, force, opts)
    if images:
        if texts_file is not None:
            raise UserError("--texts-file gives texts: it cannot be combined with --images")
        if pooling is not None or max_length is not None:
            raise UserError(f"{'--pooling' if pooling is not None else '--max-length'} applies to texts, not to --images")
        if query and out is not None:
            raise UserError("--query lists neighbours: it writes no matrix, so --out cannot go with it")
        if top_k is not None and not query:
            raise UserError("--top-k is the number of neighbours --query lists: give --query IMAGE too")
        return _embed_images(texts or [], query or [], top_k or 5, recursive, normalize, batch_size, out, matrix, force, opts)
    if query or top_k is not None or recursive:
        given = "--query" if query else "--top-k" if top_k is not None else "--recursive"
        raise UserError(f"{given} needs --images: it applies to image inputs, not texts")
    _embed_texts(read_texts(texts, texts_file), pooling, normalize, max_length, batch_size, out, matrix, force, opts)


def _plan_matrix(out: Optional[str], fmt: Optional[str], force: bool, opts: RunOptions) -> Optional[str]:
    """Check --out and --format before any work; the matrix's format (None: no --out)."""
    import sys

    from gencli.errors import UserError
    from gencli.io import names_stdout, plan_outputs, refuse_binary_terminal
    from gencli.pipelines.encoders.outputs import matrix_format

    if out is None:
        if fmt is not None:
            raise UserError("--format is the format of the --out matrix: give --out too (--json alone writes JSON lines)")
        return None
    if opts.json and names_stdout(out):
        raise UserError("-o - writes the matrix to stdout, where --json writes its lines: give -o a file, or drop --json")
    chosen = matrix_format(out, fmt)
    if chosen != "jsonl" and names_stdout(out):
        refuse_binary_terminal(sys.stdout, out)
    plan_outputs([out], force)
    return chosen


def _embed_texts(text_list, pooling, normalize, max_length, batch_size, out, matrix, force, opts: RunOptions) -> None:
    from gencli.errors import UserError
    from gencli.pipelines.vision.embed import clip_text_embeddings, is_clip_checkpoint
    from gencli.weights import resolve_model

    report = opts.report
    path = resolve_model(opts.model, DEFAULT_MODEL)
    if opts.model is not None and is_clip_checkpoint(path, opts.allow_pickle):
        if pooling is not None or max_length is not None:
            raise UserError(
                f"{'--pooling' if pooling is not None else '--max-length'} does not apply to CLIP: its text tower pools the end token of a 77-token window"
            )
        report.debug(f"embed: CLIP text tower of {path}")
        vectors = clip_text_embeddings(path, text_list, normalize=normalize, batch_size=batch_size, warn=report.warn, **opts.load_options())
    else:
        from gencli.pipelines.encoders.embed import embed_texts
        from gencli.pipelines.encoders.loading import load_encoder

        try:
            enc = load_encoder(path, task="base", **opts.load_options())
        except UserError as exc:  # an image classifier (ViT) embeds images too: say so here
            if "(an image classifier)" in str(exc) and "gencli classify" in str(exc):
                raise UserError(f"{exc}, or embed its images with gencli embed --images") from None
            raise
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
    _write(vectors, text_list, "text", out, matrix, force, opts)


def _write(vectors, names: list[str], key: str, out: Optional[str], matrix: Optional[str], force: bool, opts: RunOptions) -> None:
    """The vectors to --out (the matrix, in the format ``matrix``), to stdout as JSON lines, or as one summary line each."""
    from gencli.console import emit_json

    report = opts.report
    if out is not None:
        from gencli.pipelines.encoders.outputs import write_matrix

        write_matrix(out, vectors, names, force=force, key=key, fmt=matrix)
        report.log(f"wrote {vectors.shape[0]} x {vectors.shape[1]} embeddings to {'stdout' if out == '-' else out} ({matrix})")
        if not report.json:
            return
    for name, vec in zip(names, vectors.tolist()):
        if report.json:
            emit_json({key: name, "embedding": vec})
        else:
            typer.echo(_summary(vec, name))


def _summary(vec: list[float], name: str) -> str:
    norm = sum(v * v for v in vec) ** 0.5
    head = " ".join(f"{v:+.4f}" for v in vec[:6])
    return f"{len(vec)}-d  norm {norm:.4f}  [{head} ...]  {name}"


def _embed_images(inputs, queries, top_k, recursive, normalize, batch_size, out, matrix, force, opts: RunOptions) -> None:
    import torch

    from gencli.console import emit_json
    from gencli.errors import UserError
    from gencli.pipelines.vision.embed import DEFAULT_MODEL as IMAGE_MODEL
    from gencli.pipelines.vision.embed import load_image_embedder
    from gencli.pipelines.vision.images import ImageReadError, image_paths, load_image, predict_image_files, unreadable_inputs_error
    from gencli.weights import resolve_model

    report = opts.report
    if not inputs:
        raise UserError("no images: give image files, directories, or - for paths on stdin")
    paths = image_paths(inputs, recursive=recursive)  # bad inputs fail before the model loads
    query_images = []
    for q in queries:
        try:
            query_images.append(load_image(q))
        except ImageReadError as exc:
            raise UserError(f"--query {exc}") from None
    embedder = load_image_embedder(resolve_model(opts.model, IMAGE_MODEL), normalize=normalize, warn=report.warn, **opts.load_options())
    report.debug(f"embed --images: {embedder.describe()}")
    names: list[str] = []
    rows: list[torch.Tensor] = []
    failed: list[str] = []
    listing = bool(queries)
    with report.progress("embedding", total=len(paths)) as advance:
        for r in predict_image_files(paths, lambda ims: list(embedder.embed(ims)), batch_size=batch_size):
            advance(1)
            if r.error is not None:
                failed.append(r.path)
                report.error(f"'{r.path}': {r.error}")
                if report.json and out is None and not listing:
                    emit_json({"image": r.path, "error": r.error})
                continue
            names.append(r.path)
            rows.append(r.value)
            if out is None and not listing:  # stream: one line per image as it comes
                vec = r.value.tolist()
                emit_json({"image": r.path, "embedding": vec}) if report.json else typer.echo(_summary(vec, r.path))
    if out is not None:
        if failed and len(paths) > 1:
            raise UserError(f"{unreadable_inputs_error(failed, len(paths))}: --out not written (its rows would not match the inputs)")
        if failed:
            raise unreadable_inputs_error(failed, len(paths))  # the input's own line said it
        _write(torch.stack(rows), names, "image", out, matrix, force, opts)
    if listing and rows:
        _list_neighbours(queries, embedder.embed(query_images), names, torch.stack(rows), top_k, report)
    if failed:
        raise unreadable_inputs_error(failed, len(paths))


def _list_neighbours(queries, query_vectors, names, vectors, top_k, report) -> None:
    from pathlib import Path

    from gencli.console import emit_json, print_table
    from gencli.pipelines.vision.embed import nearest

    resolved = [Path(n).resolve() for n in names]
    for q, qv in zip(queries, query_vectors):
        target = Path(q).resolve()
        same = {i for i, r in enumerate(resolved) if r == target}  # the query itself is not its neighbour
        keep = [i for i in range(len(names)) if i not in same]
        if not keep:
            report.warn(f"--query '{q}': no other image to compare it with")
            continue
        found = nearest(qv[None], vectors[keep], top_k)[0]
        hits = [{"rank": rank, "image": names[keep[j]], "cosine": cos} for rank, (j, cos) in enumerate(found, 1)]
        if report.json:
            emit_json({"query": q, "neighbours": hits})
        else:
            print_table(_neighbour_table(q, hits))


def _neighbour_table(query: str, hits):
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, header_style="bold", show_edge=False, pad_edge=False)
    for name, justify in (("query", "left"), ("rank", "right"), ("cosine", "right"), ("image", "left")):
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for h in hits:  # paths as Text: a name with [brackets] is not rich markup
        table.add_row(Text(query), str(h["rank"]), f"{h['cosine']:.4f}", Text(h["image"]))
    return table
