"""What every command shares: the common options, the command decorator and error handling.

Output (stderr lines, JSON lines, tables, progress) goes through :mod:`gencli.console`. Nothing here
imports torch: ``gencli --help`` must stay fast. Command bodies import their pipeline (and with it
torch) only when they run.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Optional

import typer

from gencli.backend.names import DEVICE_PATTERN
from gencli.console import Reporter, stderr
from gencli.errors import UserError


class Dtype(str, enum.Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Quantize(str, enum.Enum):
    """Weight-only quantization modes (gencli.backend.quantize.MODES)."""

    int8 = "int8"
    int4 = "int4"


def _check_device(value: str) -> str:
    if not DEVICE_PATTERN.match(value):
        raise typer.BadParameter(f"'{value}' is not one of auto, cpu, cuda, cuda:N, mps")
    return value


def _check_threads(value: Optional[int]) -> Optional[int]:
    if value is not None and value < 1:
        raise typer.BadParameter("must be at least 1")
    return value


@dataclass
class RunOptions:
    """The options every command accepts: what to load and where (passed on to the pipeline, which
    chooses the placement), and the :class:`~gencli.console.Reporter` the run reports through."""

    model: Optional[str] = None
    device: str = "auto"
    dtype: str = "auto"
    seed: Optional[int] = None
    threads: Optional[int] = None
    allow_pickle: bool = False
    debug: bool = False
    report: Reporter = field(default_factory=Reporter)

    @property
    def json(self) -> bool:
        return self.report.json

    def load_options(self) -> dict[str, Any]:
        """``--device/--dtype/--threads/--allow-pickle`` as the pipelines' loaders take them."""
        return {"device": self.device, "dtype": self.dtype, "threads": self.threads, "allow_pickle": self.allow_pickle}


# -- the common options, as typer parameters -----------------------------------------------
def _opt(annotation: Any, default: Any) -> tuple[Any, Any]:
    return annotation, default


_COMMON_PARAMS: dict[str, tuple[Any, Any]] = {
    "model": _opt(
        Annotated[
            Optional[str],
            typer.Option("--model", "-m", help="A model folder, a .safetensors file, or an embedded default's name.", rich_help_panel="Common options"),
        ],
        None,
    ),
    "device": _opt(
        Annotated[
            str,
            typer.Option("--device", help="auto, cpu, cuda, cuda:N or mps.", callback=_check_device, rich_help_panel="Common options"),
        ],
        "auto",
    ),
    "dtype": _opt(
        Annotated[
            Dtype,
            typer.Option("--dtype", help="auto picks the fastest dtype without measurable quality loss on the device.", rich_help_panel="Common options"),
        ],
        Dtype.auto,
    ),
    "seed": _opt(
        Annotated[Optional[int], typer.Option("--seed", help="Seed for sampling: same seed, same result on any device.", rich_help_panel="Common options")],
        None,
    ),
    "threads": _opt(
        Annotated[
            Optional[int],
            typer.Option(
                "--threads",
                help="CPU threads for torch (default: torch's choice, or $GENCLI_THREADS).",
                callback=_check_threads,
                rich_help_panel="Common options",
            ),
        ],
        None,
    ),
    "allow_pickle": _opt(
        Annotated[
            bool,
            typer.Option(
                "--allow-pickle", help="Allow .bin/.pt/.ckpt checkpoints (loaded with torch.load(weights_only=True)).", rich_help_panel="Common options"
            ),
        ],
        False,
    ),
}

_OUTPUT_PARAMS: dict[str, tuple[Any, Any]] = {
    "json": _opt(Annotated[bool, typer.Option("--json", help="Write JSON lines to stdout.", rich_help_panel="Output")], False),
    "quiet": _opt(Annotated[bool, typer.Option("--quiet", "-q", help="No progress or logs on stderr.", rich_help_panel="Output")], False),
    "verbose": _opt(
        Annotated[bool, typer.Option("--verbose", "-v", help="Log choices (device, dtype) and timings to stderr.", rich_help_panel="Output")], False
    ),
    "debug": _opt(Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.", rich_help_panel="Output")], False),
}


def run_guarded(opts: RunOptions, body: Callable[[], Any]) -> Any:
    """Run a command body, mapping errors onto the exit-code contract.

    UserError -> one line on stderr, exit 2. Anything unexpected -> one line (traceback with --debug),
    exit 1. Ctrl-C -> exit 130.
    """
    try:
        return body()
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except UserError as exc:
        if opts.debug:
            traceback.print_exc()
        opts.report.error(str(exc))
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        stderr.print("interrupted", markup=False)
        raise typer.Exit(130) from None
    except BrokenPipeError:
        # the reader of our stdout went away (e.g. `| head`): not an error of ours
        with contextlib.suppress(Exception):
            sys.stdout = open(os.devnull, "w")
        raise typer.Exit(0) from None
    except Exception as exc:  # noqa: BLE001 - the contract: exit 1 for internal errors
        if opts.debug:
            traceback.print_exc()
            stderr.print(f"internal error: {type(exc).__name__}: {exc}", markup=False, style="red")
        else:
            stderr.print(f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)", markup=False, style="red")
        raise typer.Exit(1) from None


def command(app: typer.Typer, name: str, *, model_options: bool = True, **typer_kwargs: Any) -> Callable:
    """Register ``fn`` as a gencli command with the contract's common options added.

    ``fn`` declares its own parameters plus ``opts: RunOptions``; this decorator appends
    ``--model/--device/--dtype/--seed/--threads/--allow-pickle`` (when ``model_options``) and
    ``--json/--quiet/--verbose/--debug`` to its signature and wraps the body in ``run_guarded``.
    """

    def decorate(fn: Callable) -> Callable:
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != "opts"]
        extra = dict(_COMMON_PARAMS) if model_options else {}
        extra.update(_OUTPUT_PARAMS)
        injected = [
            inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, annotation=ann, default=default) for k, (ann, default) in extra.items()
        ]
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.kind != inspect.Parameter.KEYWORD_ONLY else p for p in own]

        def wrapper(**kwargs: Any) -> Any:
            common = {k: kwargs.pop(k) for k in list(kwargs) if k in extra}
            if "dtype" in common:
                common["dtype"] = common["dtype"].value if isinstance(common["dtype"], enum.Enum) else common["dtype"]
            report = Reporter(**{k: common.pop(k) for k in ("json", "quiet", "verbose")})
            opts = RunOptions(**common, report=report)
            if opts.threads is None and os.environ.get("GENCLI_THREADS", "").isdigit():
                opts.threads = int(os.environ["GENCLI_THREADS"])
            return run_guarded(opts, lambda: fn(opts=opts, **kwargs))

        wrapper.__name__ = fn.__name__
        wrapper.__qualname__ = fn.__qualname__
        wrapper.__doc__ = fn.__doc__
        wrapper.__module__ = fn.__module__
        params = own + injected
        wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        app.command(name, **typer_kwargs)(wrapper)
        return fn

    return decorate


def placeholder(app: typer.Typer, name: str, help: str, family: str) -> None:
    """Register a contract command whose model family has not landed yet.

    It accepts any arguments and exits 2 with one clear line, so scripts fail cleanly, not with a crash.
    """

    def body(ctx: typer.Context) -> None:
        from gencli.errors import NotBuiltError

        def fail() -> None:
            raise NotBuiltError(f"'gencli {name}' is not built yet: the {family} family has not landed in this version")

        run_guarded(RunOptions(), fail)

    body.__doc__ = f"{help} [not built yet]"
    app.command(name, help=f"{help} [dim](not built yet)[/dim]", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(body)
