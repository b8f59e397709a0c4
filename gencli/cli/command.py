"""The command decorator: a command body declared once, with the shared options added, its help text
reflowed, its metavars named, and its run guarded (:mod:`gencli.cli.guard`)."""

from __future__ import annotations

import enum
import inspect
from typing import Annotated, Any, Callable, Optional

import typer

from gencli.cli.guard import run_guarded
from gencli.cli.options import _COMMON_PARAMS, _OUTPUT_PARAMS, RayFlags, RunOptions, _check_seed, _is_option_group, ray_options
from gencli.console import Reporter
from gencli.errors import UserError

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

