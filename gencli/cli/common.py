"""The names command modules import: the option vocabulary (:mod:`gencli.cli.options`), the command
decorator (:mod:`gencli.cli.command`) and the guarded run (:mod:`gencli.cli.guard`)."""

from gencli.cli.command import command, reflow
from gencli.cli.guard import run_guarded, usage_error_line
from gencli.cli.options import (
    DETERMINISTIC_SEED_HELP,
    RAY_DEFAULT_ADDRESS,
    SHORT_OPTIONS,
    Dtype,
    GpusPerReplica,
    GroupSize,
    OutDir,
    Quantize,
    RayAddress,
    RayFlags,
    Replicas,
    RunOptions,
    at_least,
    bare_ray_flag,
    option,
    option_group,
    ray_options,
)

__all__ = [
    "DETERMINISTIC_SEED_HELP",
    "Dtype",
    "GpusPerReplica",
    "GroupSize",
    "OutDir",
    "Quantize",
    "RAY_DEFAULT_ADDRESS",
    "RayAddress",
    "RayFlags",
    "Replicas",
    "RunOptions",
    "SHORT_OPTIONS",
    "at_least",
    "bare_ray_flag",
    "command",
    "option",
    "option_group",
    "ray_options",
    "reflow",
    "run_guarded",
    "usage_error_line",
]
