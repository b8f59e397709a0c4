"""The ``gencli`` command-line app. One thin module per command; none imports torch at import time."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from gencli import __version__

app = typer.Typer(
    name="gencli",
    help="Run generative and predictive models from safetensors checkpoints: text generation, image "
    "classification, CLIP zero-shot, TFT forecasting, VAE/GAN sampling and text-to-image diffusion.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gencli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")] = None,
) -> None:
    """gencli: one command-line suite for generative and predictive models."""


# Each module registers its command(s) on `app` when imported; the order here is the order in --help.
from gencli.cli import (  # noqa: E402,F401,I001
    generate,
    classify,
    zeroshot,
    forecast,
    sample,
    txt2img,
    quantize,
    info,
    models,
)


def main() -> None:
    app()
