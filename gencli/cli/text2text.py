"""`gencli text2text TEXT...` and `gencli translate TEXT...`: T5, Marian and BART encoder-decoder checkpoints."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from gencli.cli import app
from gencli.cli.common import Beams, EarlyStopping, LengthPenalty, NoRepeat, Returns, RunOptions, at_least, command, option, option_group
from gencli.console import Reporter

# the embedded default of text2text (weights/t5-shapes: shapes-world captions to structures and back);
# translate has none (--model is required)
DEFAULT_MODEL: Optional[str] = "t5-shapes"

Texts = Annotated[
    Optional[list[str]], typer.Argument(metavar="TEXT...", help="Input texts, one output each; - reads one input per line from stdin.", show_default=False)
]
MaxNew = Annotated[Optional[int], option("--max-new-tokens", help="Most new tokens per input (default: generation_config.json, else 256).", show_default=False)]
MinNew = Annotated[Optional[int], option("--min-new-tokens", help="Fewest new tokens before the end token may come.", show_default=False)]
Temperature = Annotated[
    Optional[float], option("--temperature", help="Sampling temperature; 0 = greedy (default: generation_config.json, else greedy).", show_default=False)
]
TopK = Annotated[Optional[int], option("--top-k", help="Sample among the k most likely tokens; 0 = off (default 50 when sampling).", show_default=False)]
TopP = Annotated[Optional[float], option("--top-p", help="Nucleus sampling mass in (0, 1]; 1 = off.", show_default=False)]
RepPenalty = Annotated[
    Optional[float], option("--repetition-penalty", help="Penalise tokens already generated (> 1 discourages repeats; 1 = off).", show_default=False)
]
PromptsFile = Annotated[Optional[str], option("--prompts-file", help="One input per line (- = stdin), run as padded batches.", show_default=False)]
BatchSize = Annotated[int, option("--batch-size", callback=at_least(1), help="Inputs per batch.")]
Stream = Annotated[bool, option("--stream", help="Print text as it is generated (greedy and sampling; one input at a time).")]
NoTruncate = Annotated[bool, option("--no-truncate", help="Refuse inputs longer than the encoder's window instead of truncating them.")]

SEED_HELP = "Seed for sampling: the same seed gives the same text on any device."


@option_group
class DecodingOptions:
    """The options text2text and translate share: how to decode, and how the inputs come."""

    max_new_tokens: MaxNew = None
    min_new_tokens: MinNew = None
    num_beams: Beams = None
    num_return_sequences: Returns = None
    length_penalty: LengthPenalty = None
    early_stopping: EarlyStopping = None
    no_repeat_ngram_size: NoRepeat = None
    temperature: Temperature = None
    top_k: TopK = None
    top_p: TopP = None
    repetition_penalty: RepPenalty = None
    prompts_file: PromptsFile = None
    batch_size: BatchSize = 8
    stream: Stream = False
    no_truncate: NoTruncate = False

    def flags(self) -> dict:
        """The decoding settings, as :func:`gencli.pipelines.seq2seq.generate.resolve_settings` takes them."""
        return {k: getattr(self, k) for k in _SETTING_NAMES}


@command(app, "text2text", seed_help=SEED_HELP)
def text2text(
    texts: Texts = None,
    *,
    settings: DecodingOptions,
    opts: RunOptions,
) -> None:
    """Text in, text out with a T5 / Flan-T5 / mT5, Marian or BART checkpoint: one output line per input.

    Decoding settings not given as flags come from the checkpoint's generation_config.json. Without
    --model it runs the embedded t5-shapes ("parse: CAPTION" or "describe: STRUCTURE").
    Examples:

    gencli text2text "parse: a small red star at the top left on a blue background"

    gencli text2text -m ./flan-t5-small "summarize: The cat sat on the mat all day long."

    cat questions.txt | gencli text2text -m ./flan-t5-small - --num-beams 4 --json
    """
    _run(texts, settings, opts, prefix=None, default_model=DEFAULT_MODEL)


@command(app, "translate", seed_help=SEED_HELP)
def translate(
    texts: Texts = None,
    source: Annotated[Optional[str], option("--source", help="Source language name, for T5: adds 'translate SOURCE to TARGET: '.", show_default=False)] = None,
    target: Annotated[Optional[str], option("--target", help="Target language name, for T5 (with --source).", show_default=False)] = None,
    *,
    settings: DecodingOptions,
    opts: RunOptions,
) -> None:
    """Translate with a Marian (opus-mt) checkpoint, or a T5 checkpoint given --source and --target.

    Examples:

    gencli translate -m ./opus-mt-en-de "The weather is nice today."

    gencli translate -m ./t5-small --source English --target German "The house is wonderful."
    """
    from gencli.errors import UserError
    from gencli.io import check_text

    if (source is None) != (target is None):
        raise UserError("--source and --target go together (T5: 'translate SOURCE to TARGET: ')")
    for name, value in (("--source", source), ("--target", target)):
        if value is not None and not check_text(value, name).strip():
            raise UserError(f"{name} is empty: give a language name (e.g. English, German)")
    prefix = f"translate {source} to {target}: " if source is not None else None
    _run(texts, settings, opts, prefix=prefix, default_model=None)


_SETTING_NAMES = ("max_new_tokens", "min_new_tokens", "num_beams", "num_return_sequences", "length_penalty", "early_stopping", "no_repeat_ngram_size",
                  "temperature", "top_k", "top_p", "repetition_penalty")  # fmt: skip


def _run(texts, options: DecodingOptions, opts: RunOptions, *, prefix: Optional[str], default_model: Optional[str]) -> None:
    from gencli.errors import UserError

    flags, prompts_file, batch_size = options.flags(), options.prompts_file, options.batch_size
    stream, truncate = options.stream, not options.no_truncate
    from gencli.pipelines.text.flags import check_decoding_flags

    check_decoding_flags(**{k: v for k, v in flags.items() if k != "early_stopping"})
    if opts.model is None and default_model is None:
        raise UserError("no model: pass --model with a Marian (opus-mt) or T5 checkpoint folder (translate has no embedded default)")
    inputs = _read_inputs(texts, prompts_file, opts.report)
    if prefix is not None:
        inputs = [prefix + t for t in inputs]

    from gencli.pipelines.seq2seq.generate import encode_input, generate, resolve_settings
    from gencli.pipelines.seq2seq.loading import describe, load_seq2seq_model
    from gencli.pipelines.text.generate import batch_generator
    from gencli.weights import resolve_model

    report = opts.report
    path = resolve_model(opts.model, default_model)
    with report.progress("loading model"):
        sm = load_seq2seq_model(path, **opts.load_options())
    report.debug(f"model: {describe(sm)}; loaded in {sm.load_seconds:.2f}s")
    if prefix is not None and sm.family != "t5":  # a Marian/BART model would translate the T5 task prefix as text
        raise UserError(
            f"--source/--target name the languages for a T5 checkpoint; '{path}' is a {sm.architecture}, which translates its own "
            "language pair: drop --source and --target"
        )
    settings = resolve_settings(sm.generation_config, **flags, eos_ids=sm.eos_ids, seed=opts.seed, warn=report.warn)
    beam_only = [name for name, key in (("--length-penalty", "length_penalty"), ("--early-stopping", "early_stopping")) if flags.get(key) is not None]
    if beam_only and not settings.beam_search:
        raise UserError(f"{beam_only[0]} applies to beam search, which this run does not use (one beam): give --num-beams 2 or more")
    if stream and settings.beam_search:
        raise UserError(
            "--stream prints greedy or sampled text as it comes: beam search knows its best output only at the end (drop --stream or use --num-beams 1)"
        )
    if stream and settings.num_return_sequences > 1:
        raise UserError(f"--stream prints one output as it comes: --num-return-sequences {settings.num_return_sequences} gives several (drop one of them)")
    # Marian and BART decoders hold a position table: the budget of new tokens stops there (as
    # generate's stops at the model's context), a minimum past it could never be honoured
    positions, capped = sm.max_target_tokens, False
    if positions is not None and settings.max_new_tokens > positions:
        if settings.min_new_tokens > positions:
            what = f"--min-new-tokens ({settings.min_new_tokens})" if flags.get("min_new_tokens") is not None else (
                f"the generation config's minimum length ({settings.min_new_tokens} new tokens)")  # fmt: skip
            raise UserError(f"{what} is more than the decoder's {positions} positions hold: lower it")
        settings.max_new_tokens, capped = positions, True
    seed = None
    if not settings.sampling.greedy:
        from gencli.backend.random import new_seed

        seed = opts.seed if opts.seed is not None else new_seed()
    warned: list[str] = []

    def warn_once(message: str) -> None:
        if message not in warned:
            warned.append(message)
            report.warn(message)

    encoded = [(t, encode_input(sm, t, truncate=truncate, warn=warn_once)) for t in inputs]
    live = stream and not opts.json
    size = 1 if live else batch_size
    many = settings.num_return_sequences > 1
    with opts.results() as out:
        for k, start in enumerate(range(0, len(encoded), size)):
            batch = encoded[start : start + size]

            def on_text(row: int, piece: str) -> None:
                out.write(piece.replace("\n", " "))  # one line per output, as without --stream
                out.flush()

            outputs = generate(sm, batch, settings, on_text=on_text if live else None, generator=batch_generator(seed, k))
            for o in outputs:
                if capped and o.finish_reason == "length" and len(o.token_ids) >= positions:
                    warn_once(f"stopped at the decoder's {positions} positions (the most new tokens this model holds)")
                if opts.json:
                    from gencli.console import emit_json

                    emit_json(o.as_json(str(sm.path), seed, many=many), out)
                elif live:
                    out.write("\n")
                else:
                    out.write(o.text.replace("\n", " ") + "\n")
                out.flush()
            t = outputs[0].timing
            report.debug(f"encode {t['encode_s']:.3f}s, decode {t['decode_s']:.3f}s ({t['decode_tokens_per_s'] or 0:.1f} tokens/s), batch of {len(batch)}")
    if seed is not None:
        report.debug(f"seed {seed}")


def _read_inputs(texts: Optional[list[str]], prompts_file: Optional[str], report: Reporter) -> list[str]:

    from gencli.errors import UserError

    if texts and prompts_file is not None:
        raise UserError("give either TEXT arguments or --prompts-file, not both")
    if not texts and prompts_file is None:
        raise UserError("no input: give TEXT arguments, - to read one input per line from stdin, or --prompts-file FILE")
    lines: list[str] = []
    if prompts_file is not None:
        from gencli.io import read_lines

        lines, where = read_lines(prompts_file, what="--prompts-file")
    else:
        from gencli.io import check_text, read_stdin_text

        if (texts or []).count("-") > 1:  # stdin is read once: a second - would repeat its inputs
            raise UserError("stdin ('-') can be read only once")
        for i, t in enumerate(texts or []):
            if t != "-" and not check_text(t, f"text {i + 1}").strip():  # (not a blank line of stdin, skipped with a warning)
                raise UserError("the input is empty (an empty TEXT argument)")
            lines.extend(read_stdin_text().splitlines() if t == "-" else [t])
        where = "stdin" if "-" in (texts or []) else "the arguments"
    inputs = [line for line in lines if line.strip()]
    if not inputs:
        raise UserError(f"the input is empty (no text in {where})")
    if len(inputs) != len(lines):
        blank = len(lines) - len(inputs)
        if prompts_file is not None or "-" in (texts or []):
            report.warn(f"skipped {blank} blank line(s); {len(inputs)} input(s) left")
        else:
            raise UserError("the input is empty (an empty TEXT argument)")
    return inputs
