"""`gencli ner TEXT...`: named entities from a BERT-family token classifier."""

from __future__ import annotations

import enum
from typing import Annotated

from gencli.cli import app
from gencli.cli.common import DETERMINISTIC_SEED_HELP, RunOptions, at_least, command, option
from gencli.cli.embed import MaxLengthOpt, TextsArg, TextsFileOpt, read_texts

DEFAULT_MODEL = "bert-shapes-ner"  # the embedded default: tags shapes-world captions


class Aggregation(str, enum.Enum):
    simple = "simple"
    first = "first"
    average = "average"
    max = "max"
    none = "none"


@command(app, "ner", seed_help=DETERMINISTIC_SEED_HELP)
def ner(
    texts: TextsArg = None,
    texts_file: TextsFileOpt = None,
    aggregation: Annotated[
        Aggregation, option("--aggregation", help="How tokens become entities, as transformers' token-classification pipeline defines it.")
    ] = Aggregation.simple,
    max_length: MaxLengthOpt = None,
    batch_size: Annotated[int, option("--batch-size", callback=at_least(1), help="Texts per forward pass.")] = 8,
    *,
    opts: RunOptions,
) -> None:
    """Find the named entities of each text with a BERT, RoBERTa or DistilBERT token classifier.

    --aggregation: none (one entity per token), simple (adjacent tokens of one type grouped), first,
    average or max (the tokens of a word agree on a label first). With --json one line per text:
    {"text", "entities": [{"entity_group" ("entity" with none), "score", "word", "start", "end"}]},
    start and end being character offsets into the text; otherwise a table. Without --model:
    bert-shapes-ner, which tags the colour, shape, size, position and background words of shapes-world
    captions (a demonstration, not a general named-entity recogniser).
    """
    from gencli.errors import UserError
    from gencli.weights import resolve_model

    text_list = read_texts(texts, texts_file)
    from gencli.console import emit_json
    from gencli.pipelines.encoders.loading import load_encoder
    from gencli.pipelines.encoders.ner import recognize

    for i, t in enumerate(text_list):
        if not t.strip():
            raise UserError(f"text {i + 1} is empty")
    report = opts.report
    enc = load_encoder(resolve_model(opts.model, DEFAULT_MODEL), task="token_classification", **opts.load_options())
    report.debug(f"ner: {enc.describe()}")
    results = recognize(enc, text_list, aggregation=aggregation.value, max_length=max_length, batch_size=batch_size, warn=report.warn)
    key = "entity" if aggregation == Aggregation.none else "entity_group"
    with opts.results() as fh:
        for text, entities in zip(text_list, results):
            if report.json:
                emit_json({"text": text, "entities": entities}, fh)
                continue
            fh.write(f"{text}\n")
            if not entities:
                fh.write("  (no entities)\n")
            for e in entities:
                fh.write(f"  {e[key]:<12} {e['score']:.4f}  {e['start']:>4}-{e['end']:<4}  {text[e['start']:e['end']]}\n")
