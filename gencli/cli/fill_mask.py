"""`gencli fill-mask TEXT...`: the likeliest tokens for each mask, from a BERT-family masked-language model."""

from __future__ import annotations

from typing import Annotated

from gencli.cli import app
from gencli.cli.common import DETERMINISTIC_SEED_HELP, RunOptions, at_least, command, option
from gencli.cli.embed import MaxLengthOpt, TextsArg, TextsFileOpt, read_texts

DEFAULT_MODEL = "bert-pystdlib"  # the embedded default: a small BERT pretrained on the standard library's English


@command(app, "fill-mask", seed_help=DETERMINISTIC_SEED_HELP)
def fill_mask(
    texts: TextsArg = None,
    texts_file: TextsFileOpt = None,
    top_k: Annotated[int, option("--top-k", help="Predictions per mask.")] = 5,
    max_length: MaxLengthOpt = None,
    batch_size: Annotated[int, option("--batch-size", callback=at_least(1), help="Texts per forward pass.")] = 8,
    *,
    opts: RunOptions,
) -> None:
    """Predict the masked words of each text with a BERT, RoBERTa or DistilBERT masked-language model.

    Write [MASK] where a word goes ([MASK] works for every model; RoBERTa's <mask> too). With --json one
    line per text: {"text", "predictions": [{"score", "token", "token_str", "sequence"}]}, the fields of
    transformers' fill-mask pipeline; a text with several masks gives one predictions list per mask.
    Without --model: bert-pystdlib, a small BERT pretrained on the docstrings and comments of Python's
    standard library (a demonstration of the task, not a general English model).
    """
    from gencli.weights import resolve_model

    text_list = read_texts(texts, texts_file)
    from gencli.pipelines.encoders.fill_mask import fill_mask as run
    from gencli.pipelines.encoders.loading import load_encoder

    report = opts.report
    enc = load_encoder(resolve_model(opts.model, DEFAULT_MODEL), task="masked_lm", **opts.load_options())
    report.debug(f"fill-mask: {enc.describe()}")
    results = run(enc, text_list, top_k=top_k, max_length=max_length, batch_size=batch_size, warn=report.warn)
    from gencli.console import emit_json

    with opts.results() as fh:
        for text, per_mask in zip(text_list, results):
            if report.json:
                emit_json({"text": text, "predictions": per_mask[0] if len(per_mask) == 1 else per_mask}, fh)
                continue
            fh.write(f"{text}\n")
            for m, preds in enumerate(per_mask):
                if len(per_mask) > 1:
                    fh.write(f"  mask {m + 1}:\n")
                for p in preds:
                    fh.write(f"  {p['score']:.4f}  {p['token_str']!s:<16} {p['sequence']}\n")
