"""What every command shares: the common options, the command decorator and error handling.

Output (stderr lines, JSON lines, tables, progress) goes through :mod:`gencli.console`. Nothing here
imports torch: ``gencli --help`` must stay fast. Command bodies import their pipeline (and with it
torch) only when they run.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import signal
import sys
import threading
import traceback
import warnings
from dataclasses import dataclass, field
from typing import IO, Annotated, Any, Callable, Iterator, Optional

import typer

from gencli.backend.names import DEVICE_PATTERN
from gencli.console import Reporter, guarded_stdout, open_output, stderr
from gencli.errors import Notice, Terminated, UserError

# -- the option vocabulary: one meaning per short option, in every command --------------------------
# A command that has one of these long options gives it this short form; no command gives a short
# form to anything else (tests/test_shell.py checks every registered command against this table).
SHORT_OPTIONS: dict[str, str] = {
    "--help": "-h",
    "--model": "-m",
    "--out": "-o",
    "--force": "-f",
    "--quiet": "-q",
    "--verbose": "-v",
    "--top-k": "-k",
    "--batch-size": "-b",
    "--recursive": "-r",
    "--labels": "-l",
    "--images": "-i",
    "--horizon": "-H",
    "--max-new-tokens": "-n",  # -n is "how many to produce": new tokens here, images in sample/txt2img
    "--num-images": "-n",
    "--num": "-n",
    "--negative-prompt": "-N",
    "--guidance": "-g",
    "--sampler": "-s",
}


_RAY = "Scaling out (Ray)"
# ``--ray [ADDRESS]``: a bare ``--ray`` (last, or before another option) means ``--ray local`` (see
# :func:`bare_ray_flag`); the value is checked by the distributed pipeline.
RayAddress = Annotated[
    Optional[str],
    typer.Option(
        "--ray",
        metavar="[ADDRESS]",
        help="Run on Ray Data: local (a Ray runtime on this machine; the value of a bare --ray), auto (the cluster `ray start` joined), "
        "HOST:PORT or ray://HOST:10001. Needs pip install 'gencli\\[ray]'.",
        rich_help_panel=_RAY,
    ),
]
Replicas = Annotated[
    Optional[int],
    typer.Option("--replicas", help="Model replicas with --ray (default: one per GPU, else one per CPU but one).", rich_help_panel=_RAY),
]
GpusPerReplica = Annotated[
    Optional[float],
    typer.Option("--gpus-per-replica", metavar="NUMBER", help="GPUs per replica with --ray (default: 1 where the cluster has GPUs).", rich_help_panel=_RAY),
]
OutDir = Annotated[
    Optional[str],
    typer.Option(
        "--out-dir", help="With --ray: the replicas write sharded results into this new directory (part-*.csv or .txt, .jsonl with --json).",
        rich_help_panel=_RAY
    ),
]
RAY_DEFAULT_ADDRESS = "local"


def bare_ray_flag(args: list[str]) -> list[str]:
    """``--ray`` with no value (last, or followed by another option) becomes ``--ray local``."""
    out = list(args)
    for i, a in enumerate(args):
        if a == "--":
            break
        if a == "--ray" and (i + 1 == len(args) or args[i + 1].startswith("-")):
            out.insert(i + 1 + (len(out) - len(args)), RAY_DEFAULT_ADDRESS)
    return out


def option_group(cls: type) -> type:
    """Make ``cls`` a dataclass of command options that several commands share.

    Each field is declared once, as a typer option (an ``Annotated`` type) with its default. A command
    parameter annotated with the class is expanded by :func:`command` into those options, in field
    order and at the parameter's place (so ``--help`` lists them where the parameter stands), and
    the body receives one instance of the class."""
    cls = dataclass(cls)
    cls.__option_group__ = True  # type: ignore[attr-defined]
    return cls


def _is_option_group(annotation: Any) -> bool:
    return isinstance(annotation, type) and getattr(annotation, "__option_group__", False)


@option_group
class RayFlags:
    """``--ray/--replicas/--gpus-per-replica/--out-dir`` as typed; :func:`command` with ``ray=True``
    adds them and turns them into the distributed pipeline's options (:func:`ray_options`)."""

    ray: RayAddress = None
    replicas: Replicas = None
    gpus_per_replica: GpusPerReplica = None
    out_dir: OutDir = None


def ray_options(flags: RayFlags, force: bool):
    """The distributed pipeline's ``RayOptions`` (None without --ray: the --ray options are then refused)."""
    from gencli.pipelines.distributed.runtime import RayOptions, refuse_without_ray

    opts = RayOptions(flags.ray or RAY_DEFAULT_ADDRESS, flags.replicas, flags.gpus_per_replica, flags.out_dir, force)
    if flags.ray is None:
        refuse_without_ray(opts)
        return None
    return opts


DETERMINISTIC_SEED_HELP = "Accepted by every model command; this one is deterministic and draws no random numbers."


def option(long: str, *more: str, **kwargs: Any) -> Any:
    """``typer.Option`` for ``long`` (plus any further long aliases), with its short form from the
    vocabulary (:data:`SHORT_OPTIONS`) when it has one. Every command declares options through this."""
    if any(not m.startswith("--") for m in more):
        raise ValueError(f"{long}: short options come from SHORT_OPTIONS only")
    names = [long, *more] + ([SHORT_OPTIONS[long]] if long in SHORT_OPTIONS else [])
    return typer.Option(*names, **kwargs)


def at_least(low: int) -> Callable[[Any], Any]:
    """A typer callback: the option's value must be ``>= low`` (one message style for every command)."""

    def check(value: Any) -> Any:
        if value is not None and value < low:
            raise typer.BadParameter(f"must be at least {low} (got {value})")
        return value

    return check


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


def _check_seed(value: Optional[int]) -> Optional[int]:
    """``--seed``: the one seed type (:mod:`gencli.backend.seeds`), refused as a usage error when out of range."""
    from gencli.backend.seeds import MAX_SEED

    if value is not None and not 0 <= value <= MAX_SEED:
        raise typer.BadParameter(f"must be from 0 to {MAX_SEED} (2**32 - 1), got {value}")
    return value


def _check_threads(value: Optional[int]) -> Optional[int]:
    if value is not None and value < 1:
        raise typer.BadParameter(f"must be at least 1 (got {value})")
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
    out: Optional[str] = None
    force: bool = False
    report: Reporter = field(default_factory=Reporter)

    @property
    def json(self) -> bool:
        return self.report.json

    @contextlib.contextmanager
    def results(self, *, newline: Optional[str] = None) -> Iterator[IO[str]]:
        """Where the command's results go: ``--out FILE`` (atomic; ``-`` = stdout) or stdout.

        The one rule of every command: results go to exactly one place, in the format the options
        chose (``--json`` JSON lines, else the command's text/CSV); logs go to stderr."""
        with open_output(self.out, self.force, newline=newline) as fh:
            yield fh

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
            option("--model", help="A model folder, a .safetensors file, or an embedded default's name.", rich_help_panel="Common options"),
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
        Annotated[Optional[int], typer.Option("--seed", callback=_check_seed, help="(set per command)", rich_help_panel="Common options")],
        None,
    ),
    "threads": _opt(
        Annotated[
            Optional[int],
            typer.Option(
                "--threads",
                help="CPU threads for torch, at most the usable cores (default: $GENCLI_THREADS, else 1 for small models and the usable cores, "
                "at most 16, for large ones).",
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
    "json": _opt(Annotated[bool, typer.Option("--json", help="Results as JSON lines (to --out, else stdout).", rich_help_panel="Output")], False),
    "out": _opt(
        Annotated[
            Optional[str],
            option("--out", metavar="PATH", help="Write the results to this file instead of stdout (atomically; - = stdout).", rich_help_panel="Output"),
        ],
        None,
    ),
    "force": _opt(Annotated[bool, option("--force", help="Overwrite existing output files.", rich_help_panel="Output")], False),
    "quiet": _opt(Annotated[bool, option("--quiet", help="No progress or logs on stderr.", rich_help_panel="Output")], False),
    "verbose": _opt(
        Annotated[bool, option("--verbose", help="Log choices (device, dtype) and timings to stderr.", rich_help_panel="Output")], False
    ),
    "debug": _opt(Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.", rich_help_panel="Output")], False),
}


def _terminate(signum: int, frame: Any) -> None:
    from gencli.backend.interrupt import note_signal

    note_signal(signum)  # raised again by the long loops' checks, should this exception be lost
    raise Terminated(signum)


@contextlib.contextmanager
def _termination_as_exception() -> Iterator[None]:
    """SIGTERM/SIGHUP raise :class:`Terminated` while a command runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _notices_as_warnings(opts: RunOptions) -> Iterator[None]:
    """:class:`gencli.errors.Notice` warnings raised below the command line become ``warning:`` lines
    (once each); other Python warnings are shown as Python shows them."""
    with warnings.catch_warnings():
        original = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, Notice):
                opts.report.warn(str(message))
            else:
                original(message, category, filename, lineno, file, line)

        warnings.simplefilter("default", Notice)
        warnings.showwarning = show
        yield


def run_guarded(opts: RunOptions, body: Callable[[], Any]) -> Any:
    """Run a command body, mapping errors onto the exit-code contract.

    UserError (a refused write too: disk full) -> one line on stderr, exit 2. Anything unexpected ->
    one line (traceback with --debug), exit 1. Ctrl-C -> exit 130; SIGTERM -> 143 (SIGHUP -> 129),
    both after removing partial outputs. A closed stdout (``| head``) -> exit 0, once the output
    files the run was writing are finished (see :class:`gencli.console.StdoutGuard`).
    """
    from gencli.backend.interrupt import clear_interrupt
    from gencli.io import forget_pending_outputs

    try:
        with _termination_as_exception(), guarded_stdout(), _notices_as_warnings(opts):
            result = body()
            sys.stdout.flush()
            return result
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
    except Terminated as exc:
        stderr.print(f"terminated ({signal.Signals(exc.signum).name})", markup=False)
        raise typer.Exit(128 + exc.signum) from None
    except BrokenPipeError:
        # the reader of our stdout went away (e.g. `| head`) and no output file was pending: not an
        # error of ours; stdout already points at /dev/null, so nothing fails at exit either
        raise typer.Exit(0) from None
    except Exception as exc:  # noqa: BLE001 - the contract: exit 1 for internal errors
        if opts.debug:
            traceback.print_exc()
            stderr.print(f"internal error: {type(exc).__name__}: {exc}", markup=False, style="red")
        else:
            stderr.print(f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)", markup=False, style="red")
        raise typer.Exit(1) from None
    finally:
        clear_interrupt()
        forget_pending_outputs()


def usage_error_line(exc: typer.TyperException) -> str:
    """A click/typer usage error as the one ``error:`` line of the contract."""
    message = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    return f"error: {message}{hint}"


_TYPE_METAVARS = {int: "INT", float: "NUMBER", str: "TEXT"}
_PATH_NAMES = ("out", "file", "plot", "model", "dir", "save")


def _metavar(name: str, annotation: Any) -> Optional[str]:
    """The metavar shown in --help for an option declared without one: PATH for files and
    folders, else INT/NUMBER/TEXT (never a Python type such as ``list[str]``)."""
    import typing

    base = annotation
    for _ in range(3):
        args = [a for a in typing.get_args(base) if a is not type(None)]
        if typing.get_origin(base) in (typing.Union, list) and args:
            base = args[0]
    if base is bool:
        return ""  # a flag takes no value: nothing to show
    if any(part in name.split("_") for part in _PATH_NAMES):
        return "PATH"
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return None
    return _TYPE_METAVARS.get(base, "TEXT")


def _with_metavar(p: inspect.Parameter) -> inspect.Parameter:
    import typing

    if typing.get_origin(p.annotation) is not Annotated:
        return p
    base, *meta = typing.get_args(p.annotation)
    for info in meta:
        if isinstance(info, (typer.models.OptionInfo, typer.models.ArgumentInfo)) and info.metavar is None:
            mv = _metavar(p.name, base)
            if isinstance(info, typer.models.ArgumentInfo) and mv:
                mv = p.name.upper()
            info.metavar = mv
    return p


def _evaluated(annotation: Any, fn: Callable) -> Any:
    """A parameter's annotation, evaluated when ``from __future__ import annotations`` left it a string."""
    return eval(annotation, fn.__globals__) if isinstance(annotation, str) else annotation  # noqa: S307 - the module's own annotation


def _group_parameters(group: type) -> list[inspect.Parameter]:
    """The options of an :func:`option_group` class as keyword-only typer parameters, in field order."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(group, include_extras=True)
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[f.name], default=f.default) for f in dataclasses.fields(group)]


def reflow(doc: Optional[str]) -> Optional[str]:
    """A command's docstring as --help shows it: each paragraph one line (the terminal wraps it, never
    mid-sentence where the source happened to break), paragraphs and list items kept apart."""
    if not doc:
        return doc
    paragraphs = []
    for block in inspect.cleandoc(doc).split("\n\n"):
        lines: list[str] = []
        for line in block.splitlines():
            line = line.strip()
            if lines and not line.startswith(("- ", "* ")):
                lines[-1] += " " + line
            else:
                lines.append(line)
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


# parameters of a command body that :func:`command` supplies itself (typer never sees them)
_SUPPLIED = ("opts", "distributed")


def command(
    app: typer.Typer,
    name: str,
    *,
    model_options: bool = True,
    ray: bool = False,
    seed_help: str = "Seed: the same seed gives the same result on any device.",
    **typer_kwargs: Any,
) -> Callable:
    """Register ``fn`` as a gencli command with the contract's common options added.

    ``fn`` declares its own parameters plus ``opts: RunOptions``; a parameter annotated with an
    :func:`option_group` class stands for that group's options and receives one instance. This
    decorator appends ``--ray/--replicas/--gpus-per-replica/--out-dir`` (when ``ray``: ``fn`` then
    declares ``distributed`` and receives the distributed pipeline's ``RayOptions``, or None without
    ``--ray``), ``--model/--device/--dtype/--seed/--threads/--allow-pickle`` (when ``model_options``;
    ``seed_help`` says what the seed does in this command) and
    ``--json/--out/--force/--quiet/--verbose/--debug`` to its signature, checks ``--out`` can be
    written before the body runs, and wraps the body in ``run_guarded``.
    """

    def decorate(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        if ray != ("distributed" in sig.parameters):
            raise TypeError(f"{fn.__name__}: a command declares `distributed` exactly when it is registered with ray=True")
        groups: dict[str, type] = {"distributed": RayFlags} if ray else {}
        own: list[inspect.Parameter] = []
        for p in sig.parameters.values():
            if p.name in _SUPPLIED:
                continue
            annotation = _evaluated(p.annotation, fn)
            if _is_option_group(annotation):
                groups[p.name] = annotation
                own.extend(_group_parameters(annotation))
            else:
                own.append(p.replace(annotation=annotation, kind=inspect.Parameter.KEYWORD_ONLY))
        if ray:
            own.extend(_group_parameters(RayFlags))
        own = [_with_metavar(p) for p in own]
        declared = {p.name for p in own}
        extra = dict(_COMMON_PARAMS) if model_options else {}
        if model_options:
            ann, default = extra["seed"]
            seed_ann = Annotated[Optional[int], typer.Option("--seed", callback=_check_seed, metavar="INT", help=seed_help, rich_help_panel="Common options")]
            extra["seed"] = (seed_ann, default)
        # a command that names its own outputs (file-name patterns, a grid or a directory) declares
        # ``out``/``force`` itself and writes them; the common ones are then not added
        extra.update({k: v for k, v in _OUTPUT_PARAMS.items() if k not in declared})
        if declared & set(extra):
            raise TypeError(f"{fn.__name__}: {sorted(declared & set(extra))} are common options")
        injected = [
            _with_metavar(inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, annotation=ann, default=default)) for k, (ann, default) in extra.items()
        ]
        group_fields = {group_name: [p.name for p in _group_parameters(group)] for group_name, group in groups.items()}

        def wrapper(**kwargs: Any) -> Any:
            common = {k: kwargs.pop(k) for k in list(kwargs) if k in extra}
            if "dtype" in common:
                common["dtype"] = common["dtype"].value if isinstance(common["dtype"], enum.Enum) else common["dtype"]
            report = Reporter(**{k: common.pop(k) for k in ("json", "quiet", "verbose")})
            opts = RunOptions(**common, report=report)
            force = kwargs.get("force", opts.force)  # the command's own --force where it declares one
            for group_name, names in group_fields.items():
                kwargs[group_name] = groups[group_name](**{k: kwargs.pop(k) for k in names})

            def body() -> Any:
                if report.quiet and report.verbose:
                    raise UserError("--quiet and --verbose contradict each other: choose one")
                if opts.out is not None:
                    from gencli.io import ensure_writable

                    ensure_writable(opts.out, opts.force)  # before any long work
                if ray:
                    kwargs["distributed"] = ray_options(kwargs["distributed"], force)
                return fn(opts=opts, **kwargs)

            return run_guarded(opts, body)

        wrapper.__name__ = fn.__name__
        wrapper.__qualname__ = fn.__qualname__
        wrapper.__doc__ = fn.__doc__
        wrapper.__module__ = fn.__module__
        params = own + injected
        wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        app.command(name, **{"help": reflow(fn.__doc__), **typer_kwargs})(wrapper)
        return fn

    return decorate

