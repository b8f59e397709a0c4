"""The ``gencli`` command-line app. One thin module per command; none imports torch at import time."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from gencli import __version__


class GencliGroup(TyperGroup):
    """The click group of the app: usage errors (an unknown option, a bad value) are the contract's
    one ``error:`` line and exit 2, like every other bad input, however the app is invoked (the
    ``gencli`` script, ``python -m gencli``, a test runner); ``--help`` stays rich."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        import sys

        from gencli.cli.common import bare_ray_flag, usage_error_line
        from gencli.console import stderr

        args = bare_ray_flag(sys.argv[1:] if args is None else list(args))  # a bare --ray means --ray local
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)

        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.Abort:
            code = 1
        except typer.TyperException as exc:  # click's usage errors (typer's own copy of click)
            if type(exc).__name__ == "NoArgsIsHelpError":
                exc.show()  # `gencli` alone: the help
            else:
                stderr.print(usage_error_line(exc), markup=False, style="red")
            code = getattr(exc, "exit_code", 2)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=GencliGroup,
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
    text2text,
    classify,
    segment,
    zeroshot,
    forecast,
    sample,
    latents,
    txt2img,
    quantize,
    info,
    models,
    embed,
    fill_mask,
    classify_text,
    ner,
    qa,
)


def main() -> None:
    """The ``gencli`` entry point."""
    app()
