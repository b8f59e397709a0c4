"""`gencli classify-text TEXT...`: labels and scores from a BERT-family sequence classifier (sentiment,
topic, NLI and cross-encoder heads)."""

from __future__ import annotations

import enum
from typing import Annotated, Optional

from gencli.cli import app
from gencli.cli.common import DETERMINISTIC_SEED_HELP, RunOptions, at_least, command, option
from gencli.cli.embed import MaxLengthOpt, TextsArg, TextsFileOpt, read_texts

DEFAULT_MODEL = "bert-shapes-classify"  # the embedded default: names the shape in a shapes-world caption


class ScoreFunction(str, enum.Enum):
    softmax = "softmax"
    sigmoid = "sigmoid"
    none = "none"


def split_pairs(texts: list[str], pair: Optional[str]) -> tuple[list[str], list[Optional[str]]]:
    """(texts, pairs): ``--pair`` pairs every text with one text; otherwise a tab splits an input into
    its text and its pair."""
    if pair is not None:
        return texts, [pair] * len(texts)
    firsts: list[str] = []
    seconds: list[Optional[str]] = []
    for t in texts:
        a, sep, b = t.partition("\t")
        firsts.append(a if sep else t)
        seconds.append(b if sep else None)
    return firsts, seconds


@command(app, "classify-text", seed_help=DETERMINISTIC_SEED_HELP)
def classify_text(
    texts: TextsArg = None,
    texts_file: TextsFileOpt = None,
    pair: Annotated[
        Optional[str], option("--pair", help="Classify each text paired with this one (cross-encoders, NLI: text = premise, pair = hypothesis).")
    ] = None,
    top_k: Annotated[Optional[int], option("--top-k", help="Show the best K labels (default: all).")] = None,
    function: Annotated[
        Optional[ScoreFunction],
        option("--function", help="Override the scores: softmax, sigmoid or none (default: as transformers' pipeline decides from the head)."),
    ] = None,
    max_length: MaxLengthOpt = None,
    batch_size: Annotated[int, option("--batch-size", callback=at_least(1), help="Inputs per forward pass.")] = 8,
    *,
    opts: RunOptions,
) -> None:
    """Classify texts (or text pairs) with a BERT, RoBERTa or DistilBERT sequence classifier.

    A tab in an input (one a line on stdin with -) separates a text from its pair, for cross-encoders and
    NLI; --pair pairs every text with one text. Scores as transformers' text-classification pipeline
    gives them: softmax over the labels, a sigmoid per label for multi-label heads, the raw value for
    regression. With --json one line per input: {"text", "labels": [{"label", "score"}]} best first
    ("pair" too for a pair); a one-output head (regression, cross-encoder) gives {"text", "score"}.
    Without --model: bert-shapes-classify, which names the shape a shapes-world caption describes (a
    demonstration, not a sentiment or topic classifier).
    """
    from gencli.errors import UserError
    from gencli.weights import resolve_model

    text_list, pairs = split_pairs(read_texts(texts, texts_file, keep_tabs=pair is None), pair)
    if top_k is not None and top_k < 1:
        raise UserError("-k must be at least 1")
    from gencli.console import emit_json
    from gencli.pipelines.encoders.classify import classify_texts
    from gencli.pipelines.encoders.loading import load_encoder

    for i, t in enumerate(text_list):
        if not t.strip():
            raise UserError(f"text {i + 1} is empty")
    report = opts.report
    enc = load_encoder(resolve_model(opts.model, DEFAULT_MODEL), task="sequence_classification", **opts.load_options())
    report.debug(f"classify-text: {enc.describe()}")
    results = classify_texts(
        enc, text_list, pairs, top_k=top_k, function=function.value if function else None, max_length=max_length, batch_size=batch_size, warn=report.warn
    )
    with opts.results() as fh:
        for text, second, result in zip(text_list, pairs, results):
            record: dict = {"text": text}
            if second is not None:
                record["pair"] = second
            if isinstance(result, float):
                record["score"] = result
            else:
                record["labels"] = result
            if report.json:
                emit_json(record, fh)
                continue
            shown = text if second is None else f"{text}  |  {second}"
            if isinstance(result, float):
                fh.write(f"{result:.4f}  {shown}\n")
            else:
                best = result[0]
                rest = ", ".join(f"{r['label']} {r['score']:.4f}" for r in result[1:])
                fh.write(f"{best['label']} {best['score']:.4f}  {shown}" + (f"  ({rest})" if rest else "") + "\n")
