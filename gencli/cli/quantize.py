"""`gencli quantize MODEL OUT`: save a text model with weight-only quantized linear layers."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from gencli.cli import app
from gencli.cli.common import GroupSize, Quantize, RunOptions, at_least, command, option
from gencli.console import emit_json, human_bytes


@command(app, "quantize", model_options=False)
def quantize(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="A text model folder or .safetensors file, or an embedded default's name.", show_default=False)],
    out: Annotated[str, typer.Argument(metavar="OUT", help="The model folder to write.", show_default=False)],
    mode: Annotated[Quantize, typer.Option("--mode", help="int8 (per output channel) or int4 (in groups of --group-size).")] = Quantize.int8,
    group_size: GroupSize = None,
    force: Annotated[bool, option("--force", help="Replace OUT if an earlier gencli quantize wrote it (never another folder).")] = False,
    threads: Annotated[
        Optional[int],
        typer.Option(
            "--threads",
            help="CPU threads for torch, at most the usable cores (default: $GENCLI_THREADS, else 1 for small models and the usable cores, "
            "at most 16, for large ones).",
            callback=at_least(1),
        ),
    ] = None,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Read .bin/.pt/.ckpt checkpoints with torch.load(weights_only=True).")] = False,
    *,
    opts: RunOptions,
) -> None:
    """Quantize a GPT-2 or Llama-family model's linear layers (LM head included) and save it as a model
    folder that `gencli generate -m OUT` runs quantized without quantizing again.

    gencli quantize llama-pystdlib ./llama-int8

    gencli quantize ./gpt2 ./gpt2-int4 --mode int4 --group-size 32
    """
    from pathlib import Path

    from gencli.pipelines.text.quantization import check_quantization_flags, describe_quantization, kept_in_float
    from gencli.pipelines.text.quantized_folder import quantize_checkpoint
    from gencli.weights import resolve_model

    check_quantization_flags(mode.value, group_size, mode_flag="--mode")
    report = opts.report
    with report.progress("quantizing"):
        result = quantize_checkpoint(
            resolve_model(model), Path(out), mode.value, group_size=group_size, force=force, allow_pickle=allow_pickle, threads=threads
        )
    kept = kept_in_float(result.spec)
    if kept:  # int4: layers whose inputs the group size does not divide
        report.warn(kept)
    summary = {
        "out": str(result.out),
        "quantization": result.spec.to_config(),
        "layers": result.layers,
        "bytes_before": result.bytes_before,
        "bytes_after": result.bytes_after,
    }
    if opts.json:
        emit_json(summary)
        return
    report.say(
        f"wrote '{result.out}': {result.layers} linear layers {describe_quantization(result.spec)}, "
        f"weights {human_bytes(result.bytes_before)} -> {human_bytes(result.bytes_after)}"
    )
