"""`gencli generate PROMPT`: text generation with GPT-2 and Llama-family checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from gencli.cli import app
from gencli.cli.common import Beams, EarlyStopping, GroupSize, LengthPenalty, NoRepeat, Quantize, Returns, RunOptions, at_least, command, option

if TYPE_CHECKING:
    from gencli.pipelines.distributed.runtime import RayOptions
from gencli.console import Reporter

DEFAULT_MODEL = "llama-pystdlib"


@command(app, "generate", ray=True, seed_help="Seed for sampling: the same seed gives the same text on any device (the seed used is reported with -v).")
def generate(
    prompt: Annotated[Optional[str], typer.Argument(metavar="PROMPT", help="The prompt; - reads it from stdin.", show_default=False)] = None,
    max_new_tokens: Annotated[
        Optional[int],
        option("--max-new-tokens", help="Most new tokens per prompt (default: generation_config.json, else 256).", show_default=False),
    ] = None,
    temperature: Annotated[
        Optional[float],
        option("--temperature", help="Sampling temperature; 0 = greedy (default: generation_config.json, else greedy).", show_default=False),
    ] = None,
    top_k: Annotated[
        Optional[int],
        option("--top-k", help="Sample among the k most likely tokens; 0 = off (default: generation_config.json, else 50).", show_default=False),
    ] = None,
    top_p: Annotated[Optional[float], typer.Option("--top-p", help="Nucleus sampling mass in (0, 1]; 1 = off.", show_default=False)] = None,
    min_p: Annotated[
        Optional[float], typer.Option("--min-p", help="Drop tokens below min_p x the top token's probability; 0 = off.", show_default=False)
    ] = None,
    repetition_penalty: Annotated[
        Optional[float], typer.Option("--repetition-penalty", help="Penalise tokens already present (> 1 discourages repeats; 1 = off).", show_default=False)
    ] = None,
    num_beams: Beams = None,
    num_return_sequences: Returns = None,
    length_penalty: LengthPenalty = None,
    early_stopping: EarlyStopping = None,
    no_repeat_ngram_size: NoRepeat = None,
    min_new_tokens: Annotated[
        Optional[int], option("--min-new-tokens", help="Fewest new tokens before an end token may come (default: generation_config.json, else 0).",
                              show_default=False)
    ] = None,
    stop: Annotated[
        Optional[list[str]], typer.Option("--stop", help="Stop when this string appears (repeatable); it is not printed.", show_default=False)
    ] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Keep generating past end-of-sequence tokens (benchmarks).")] = False,
    prompts_file: Annotated[
        Optional[str], option("--prompts-file", help="One prompt per line (- = stdin), run as left-padded batches.", show_default=False)
    ] = None,
    batch_size: Annotated[int, option("--batch-size", callback=at_least(1), help="Prompts per batch with --prompts-file.")] = 8,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the checkpoint's chat template (instruct models).")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="System message for --chat.", show_default=False)] = None,
    echo: Annotated[bool, typer.Option("--echo", help="Print the prompt before the completion.")] = False,
    quantize: Annotated[
        Optional[Quantize],
        typer.Option("--quantize", help="Weight-only quantization of the linear layers on loading (int8 per channel, int4 in groups).", show_default=False),
    ] = None,
    group_size: GroupSize = None,
    compile: Annotated[
        Optional[bool],
        typer.Option(
            "--compile/--no-compile",
            help="Decode through a fixed-shape step compiled once and replayed (CUDA graphs; default: on CUDA for 128 new tokens or more).",
            show_default=False,
        ),
    ] = None,
    *,
    opts: RunOptions,
    distributed: Optional[RayOptions],
) -> None:
    """Generate text with a GPT-2 or Llama-family model; tokens stream to stdout as they are produced.

    Sampling settings not given as flags come from the checkpoint's generation_config.json.
    Examples:

    gencli generate "def fibonacci(n):"

    echo "import os" | gencli generate - --max-new-tokens 64

    gencli generate --prompts-file prompts.txt --json

    gencli generate -m ./Qwen2.5-0.5B-Instruct --chat "Name three prime numbers."

    gencli generate --quantize int8 "import os"

    gencli generate "def fibonacci(n):" --num-beams 4 --temperature 0

    gencli generate "import os" --num-return-sequences 3 --seed 1 --json

    gencli generate --prompts-file prompts.txt --seed 7 --ray --replicas 4 --out-dir completions/
    """
    from gencli.errors import UserError
    from gencli.pipelines.text.flags import check_decoding_flags
    from gencli.pipelines.text.generate import read_prompts
    from gencli.pipelines.text.quantization import check_quantization_flags

    beam_flags = dict(num_beams=num_beams, num_return_sequences=num_return_sequences, length_penalty=length_penalty, early_stopping=early_stopping,
                      no_repeat_ngram_size=no_repeat_ngram_size, min_new_tokens=min_new_tokens)  # fmt: skip
    check_decoding_flags(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, stop=stop,
        **{k: v for k, v in beam_flags.items() if k != "early_stopping"},
    )  # fmt: skip
    check_quantization_flags(quantize.value if quantize else None, group_size)
    if system is not None and not chat:
        raise UserError("--system needs --chat")
    from gencli.io import check_text

    if system is not None:
        check_text(system, "--system")
    for s in stop or []:
        check_text(s, "--stop")
    if distributed is not None and prompts_file is None:
        raise UserError("--ray needs --prompts-file (one prompt runs in this process)")
    prompts = read_prompts(prompt, prompts_file, opts.report.warn)
    if distributed is not None:
        _generate_on_ray(
            prompts, distributed, opts, echo=echo, batch_size=batch_size, chat=chat, system=system, quantize=quantize, group_size=group_size,
            settings=dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repetition_penalty=repetition_penalty, stop=stop or [], ignore_eos=ignore_eos, **beam_flags),
        )  # fmt: skip
        return

    from gencli.pipelines.text.generate import encode_prompt, make_sampler_generator, resolve_settings, warn_unapplied_settings
    from gencli.pipelines.text.loading import describe, load_text_model
    from gencli.weights import resolve_model

    report = opts.report
    path = resolve_model(opts.model, DEFAULT_MODEL)
    with report.progress("loading model"):
        tm = load_text_model(path, **opts.load_options(), quantize=quantize.value if quantize else None, group_size=group_size)
    report.debug(f"model: {describe(tm)}; loaded in {tm.load_seconds:.2f}s")
    if quantize is not None:  # --quantize int4 that left layers in float says so, as gencli quantize does
        from gencli.pipelines.text.quantization import kept_in_float

        kept = kept_in_float(tm.quantization)
        if kept:
            report.warn(kept)
    warn_unapplied_settings(tm.generation_config, report.warn)
    settings = resolve_settings(
        tm.generation_config,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        stop=stop or [],
        ignore_eos=ignore_eos,
        seed=opts.seed,
        **beam_flags,
        warn=report.warn,
    )
    settings.compile = compile
    _, seed = make_sampler_generator(settings)
    s = settings.sampling
    report.debug(
        ("greedy decoding" if s.greedy else f"sampling: temperature {s.temperature}, top-k {s.top_k}, top-p {s.top_p}, min-p {s.min_p}, seed {seed}")
        + f", repetition penalty {s.repetition_penalty}, max {settings.max_new_tokens} new tokens"
        + (f", beam search: {settings.num_beams} beams, length penalty {settings.length_penalty}" if settings.num_beams > 1 else "")
        + (f", no repeated {settings.no_repeat_ngram_size}-grams" if settings.no_repeat_ngram_size else "")
    )
    encoded = [(p, encode_prompt(tm, p, chat=chat, system=system)) for p in prompts]
    # one sequence a prompt streams; beam search knows its best only at the end
    single = prompt is not None and prompts_file is None and settings.num_beams == 1 and settings.num_return_sequences == 1
    with opts.results() as out:
        _run_batches(tm, encoded, settings, seed, report, out, stream=single and not opts.json, echo=echo, batch_size=batch_size)
    if seed is not None:
        report.debug(f"seed {seed}")


def _generate_on_ray(prompts, distributed, opts: RunOptions, *, echo: bool, batch_size: int, chat: bool, system, quantize, group_size, settings) -> None:
    """``--ray``: replicas generate the single-process batches (one seed for all: --seed, else a fresh
    one, reported with -v) and the completions come back in prompt order."""
    import functools

    from gencli.backend.random import new_seed
    from gencli.cli.render import write_completions
    from gencli.pipelines.text.loading import load_text_model
    from gencli.pipelines.text.ray import generate_prompts
    from gencli.weights import resolve_model

    report = opts.report
    seed = opts.seed if opts.seed is not None else new_seed()
    load = functools.partial(
        load_text_model, resolve_model(opts.model, DEFAULT_MODEL), **opts.load_options(), quantize=quantize.value if quantize else None, group_size=group_size
    )
    runs = generate_prompts(
        prompts, load, {**settings, "seed": seed}, distributed, report, batch_size=batch_size, chat=chat, system=system, device=opts.device, out=opts.out,
        echo=echo, write=write_completions,
    )
    if distributed.out_dir:
        n = sum(len(completions) for completions, *_ in runs)
        report.log(f"{n} completion(s) -> shards in {distributed.out_dir}")
    else:
        with opts.results() as out:
            write_completions(runs, report, out, echo=echo, many=len(prompts) > 1)
    report.debug(f"seed {seed} (used when the settings sample)")


def _run_batches(tm, encoded, settings, seed: Optional[int], report: Reporter, out, *, stream: bool, echo: bool, batch_size: int) -> None:
    """Generate for the encoded prompts ``batch_size`` at a time (batch k sampling from
    :func:`~gencli.pipelines.text.generate.batch_generator`) and write the completions to ``out``: streamed
    piece by piece for a single prompt, else each whole (one JSON line each with --json)."""
    from gencli.cli.render import write_completions
    from gencli.pipelines.text.generate import batch_generator
    from gencli.pipelines.text.generate import generate as run

    def on_text(row: int, piece: str) -> None:
        out.write(piece)
        out.flush()

    def batches():
        for k, start in enumerate(range(0, len(encoded), batch_size)):
            batch = encoded[start : start + batch_size]
            if stream and echo:
                out.write(batch[0][0])
                out.flush()
            completions = run(tm, batch, settings, on_text=on_text if stream else None, generator=batch_generator(seed, k), on_info=report.log)
            yield completions, str(tm.path), tm.context_length, seed

    write_completions(batches(), report, out, stream=stream, echo=echo, many=len(encoded) > 1 or settings.num_return_sequences > 1)
