"""The option vocabulary every command shares: the short options, the common and output options,
:class:`RunOptions` that a command body receives, option groups, the --ray flags, value checks."""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field
from typing import IO, Annotated, Any, Callable, Iterator, Optional

import typer

from gencli.backend.names import DEVICE_PATTERN
from gencli.console import Reporter, open_output

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


# ``--group-size`` of the commands that quantize (generate, quantize); the value is checked by
# gencli.pipelines.text.quantization.check_quantization_flags (gencli.backend.quantize.INT4_GROUP_SIZES)
GroupSize = Annotated[
    Optional[int],
    typer.Option("--group-size", help="int4 only: input columns per scale, 32 (default), 64, 128 or 256.", show_default=False),
]


# the beam search options of generate, text2text and translate
Beams = Annotated[
    Optional[int],
    option("--num-beams", help="Beam search with this many beams; 1 = greedy or sampling (default: generation_config.json, else 1).", show_default=False),
]
Returns = Annotated[
    Optional[int], option("--num-return-sequences", help="Outputs per input: sampled ones, or the best beams first (at most --num-beams).", show_default=False)
]
LengthPenalty = Annotated[
    Optional[float], option("--length-penalty", help="Beam scores are divided by length ** this (> 0 favours longer outputs).", show_default=False)
]
EarlyStopping = Annotated[
    Optional[bool], option("--early-stopping/--no-early-stopping", help="Beam search stops once --num-beams hypotheses have ended.", show_default=False)
]
NoRepeat = Annotated[Optional[int], option("--no-repeat-ngram-size", help="Never repeat an n-gram of this size; 0 = off.", show_default=False)]


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

