"""What every command shares: common options, error handling, JSON lines, logs and progress.

Nothing here imports torch: ``gencli --help`` must stay fast. Command bodies import their
pipeline (and with it torch) only when they run.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import json
import os
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Iterator, Optional

import typer
from rich.console import Console

from gencli.errors import UserError

# Logs, progress and errors: always stderr. stdout carries results only.
stderr = Console(stderr=True, highlight=False, soft_wrap=True)


class Dtype(str, enum.Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def _check_device(value: str) -> str:
    if not _DEVICE_RE.match(value):
        raise typer.BadParameter(f"'{value}' is not one of auto, cpu, cuda, cuda:N, mps")
    return value


def _check_threads(value: Optional[int]) -> Optional[int]:
    if value is not None and value < 1:
        raise typer.BadParameter("must be at least 1")
    return value


@dataclass
class RunOptions:
    """The options every command accepts, gathered in one object for the pipelines."""

    model: Optional[str] = None
    device: str = "auto"
    dtype: str = "auto"
    seed: Optional[int] = None
    json: bool = False
    quiet: bool = False
    verbose: bool = False
    debug: bool = False
    threads: Optional[int] = None
    allow_pickle: bool = False

    # -- output helpers -------------------------------------------------------------------
    @property
    def interactive(self) -> bool:
        """Human-facing extras (progress bars, info logs) only on a terminal and not --quiet."""
        return not self.quiet and stderr.is_terminal

    def log(self, message: str) -> None:
        """An informational line on stderr: shown on a terminal or with --verbose, never with --quiet."""
        if not self.quiet and (self.verbose or stderr.is_terminal):
            stderr.print(message, markup=False)

    def debug_log(self, message: str) -> None:
        """A line shown only with --verbose (device/dtype choices, timings)."""
        if self.verbose and not self.quiet:
            stderr.print(message, markup=False)

    def warn(self, message: str) -> None:
        """A warning on stderr; shown unless --quiet."""
        if not self.quiet:
            stderr.print(f"warning: {message}", markup=False, style="yellow")

    @contextlib.contextmanager
    def progress(self, description: str, total: Optional[float] = None) -> Iterator[Callable[..., None]]:
        """A rich progress bar on stderr when it is a terminal; a no-op in pipelines and with --quiet.

        Yields ``advance(n=1, description=None)``.
        """
        if not self.interactive:
            yield lambda n=1, description=None: None
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn()]
        if total is not None:
            columns += [MofNCompleteColumn(), TimeRemainingColumn()]
        columns.append(TimeElapsedColumn())
        with Progress(*columns, console=stderr, transient=True) as bar:
            task = bar.add_task(description, total=total)

            def advance(n: float = 1, description: Optional[str] = None) -> None:
                bar.update(task, advance=n, **({"description": description} if description else {}))

            yield advance


def emit_json(obj: Any) -> None:
    """Write one JSON object as one line on stdout and flush (JSON lines for pipelines)."""
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


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
            typer.Option("--threads", help="CPU threads for torch (default: torch's choice, or $GENCLI_THREADS).", callback=_check_threads, rich_help_panel="Common options"),
        ],
        None,
    ),
    "allow_pickle": _opt(
        Annotated[
            bool,
            typer.Option("--allow-pickle", help="Allow .bin/.pt/.ckpt checkpoints (loaded with torch.load(weights_only=True)).", rich_help_panel="Common options"),
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
        stderr.print(f"error: {exc}", markup=False, style="red")
        raise typer.Exit(exc.exit_code)
    except KeyboardInterrupt:
        stderr.print("interrupted", markup=False)
        raise typer.Exit(130)
    except BrokenPipeError:
        # the reader of our stdout went away (e.g. `| head`): not an error of ours
        with contextlib.suppress(Exception):
            sys.stdout = open(os.devnull, "w")
        raise typer.Exit(0)
    except Exception as exc:  # noqa: BLE001 - the contract: exit 1 for internal errors
        if opts.debug:
            traceback.print_exc()
            stderr.print(f"internal error: {type(exc).__name__}: {exc}", markup=False, style="red")
        else:
            stderr.print(f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)", markup=False, style="red")
        raise typer.Exit(1)


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
            opts = RunOptions(**common)
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
