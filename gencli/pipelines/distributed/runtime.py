"""Starting or joining the Ray runtime, and what every ``--ray`` command shares.

``--ray local`` starts a Ray runtime on this machine with a bounded number of logical CPUs (one per
replica plus one for reading and gathering); ``--ray auto`` joins the cluster started on this
machine with ``ray start``; ``--ray HOST:PORT`` joins a cluster's head (the GCS port, 6379 by
default) and ``--ray ray://HOST:10001`` connects through Ray Client. An address that does not answer
within :data:`CONNECT_TIMEOUT_S` seconds is one error line, never a hang. Ray itself is imported by
:func:`ray_runtime` only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from gencli.console import Reporter
from gencli.errors import UserError

CONNECT_TIMEOUT_S = 10.0
INSTALL_HINT = "pip install 'gencli[ray]' (or: pip install 'ray[data]')"
_ADDRESS = re.compile(r"^(?:ray://)?(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")
SHARD_PREFIX = "part-"


@dataclass
class RayOptions:
    """``--ray ADDRESS --replicas N --gpus-per-replica G --out-dir DIR`` (with ``--force``)."""

    address: str = "local"
    replicas: Optional[int] = None  # None: one per GPU where the cluster has GPUs, else one per CPU but one
    gpus_per_replica: Optional[float] = None  # None: 1 where the cluster has GPUs (and --device allows), else 0
    out_dir: Optional[str] = None
    force: bool = False


def check_options(opts: RayOptions, *, out: Optional[str] = None) -> None:
    """Fail fast on the ``--ray`` options, before anything is read or started."""
    if opts.address not in ("local", "auto") and not _ADDRESS.match(opts.address):
        raise UserError(
            f"--ray: '{opts.address}' is not an address (local, auto, HOST:PORT or ray://HOST:PORT); "
            "give it as --ray=local, or put --ray after the inputs"
        )
    if opts.replicas is not None and opts.replicas < 1:
        raise UserError(f"--replicas must be at least 1 (got {opts.replicas})")
    if opts.gpus_per_replica is not None and not 0 <= opts.gpus_per_replica < float("inf"):
        raise UserError(f"--gpus-per-replica must be a finite number, 0 or more (got {opts.gpus_per_replica:g})")
    if opts.out_dir is not None:
        if out is not None:
            raise UserError("--out and --out-dir are exclusive: one file, or shards in a directory")
        check_out_dir(opts.out_dir, opts.force)


def refuse(unsupported: Sequence[tuple[str, Any]], why: str = "") -> None:
    """``--ray`` with an option it cannot honour: one line naming the first such option given."""
    for name, value in unsupported:
        if value not in (None, False, 0, "", []):
            raise UserError(f"--ray cannot honour {name}" + (f": {why}" if why else "") + " (run without --ray for it)")


def refuse_without_ray(opts: RayOptions) -> None:
    """The ``--ray`` options given without ``--ray``."""
    for name, value in (("--replicas", opts.replicas), ("--gpus-per-replica", opts.gpus_per_replica), ("--out-dir", opts.out_dir)):
        if value is not None:
            raise UserError(f"{name} needs --ray (a local Ray runtime: --ray local)")


def check_out_dir(path: str, force: bool) -> Path:
    """``--out-dir``: a new directory, or an existing one with ``--force`` (its old shards go); never ``-``."""
    from gencli.io import check_output_dir

    p = check_output_dir(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"--out-dir '{p}' exists and is not a directory")
    if p.is_dir() and any(p.iterdir()) and not force:
        raise UserError(f"--out-dir '{p}' already exists (use --force to replace its shards)")
    if not p.resolve().parent.is_dir():
        raise UserError(f"--out-dir: the parent directory of '{p}' does not exist")
    return p


def prepare_out_dir(path: str) -> Path:
    """Create ``--out-dir`` (checked by :func:`check_out_dir`) and remove the shards of an earlier run."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    for old in p.glob(f"{SHARD_PREFIX}*"):
        if old.is_file():
            old.unlink()
        elif old.is_dir():
            shutil.rmtree(old)
    return p


def shard_name(first_key: Sequence[int], suffix: str) -> str:
    """The file name of the shard whose first item has sort key ``first_key`` (input file, position):
    the names sort in input order."""
    return SHARD_PREFIX + "-".join(f"{int(k):09d}" for k in first_key) + suffix


def _reachable(address: str) -> None:
    m = _ADDRESS.match(address)
    if m is None:
        return
    host, port = m.group("host").strip("[]"), int(m.group("port"))
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        why = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or str(exc))
        raise UserError(f"--ray: cannot reach the Ray cluster at '{address}' ({why} within {CONNECT_TIMEOUT_S:g} s)") from None


def _import_ray():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network calls from the driver
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise UserError(f"--ray needs Ray Data, which is not installed: {INSTALL_HINT}") from None
    return ray


@dataclass
class Cluster:
    """The joined runtime: its logical CPUs and GPUs, and the replicas and GPUs per replica to use."""

    cpus: float
    gpus: float
    replicas: int
    gpus_per_replica: float

    def actor_pool(self) -> dict[str, Any]:
        """The ``map_batches`` arguments of a pool of model replicas (each loads the model once)."""
        import ray.data

        return {"compute": ray.data.ActorPoolStrategy(size=self.replicas), "num_cpus": 1, "num_gpus": self.gpus_per_replica}

    def describe(self) -> str:
        gpu = f", {self.gpus_per_replica:g} GPU each" if self.gpus_per_replica else ""
        return f"{self.replicas} replica{'s' if self.replicas != 1 else ''}{gpu} on a Ray runtime with {self.cpus:g} CPUs, {self.gpus:g} GPUs"


@contextlib.contextmanager
def ray_runtime(opts: RayOptions, report: Reporter, *, device: str = "auto") -> Iterator[Cluster]:
    """Start (``local``) or join the Ray runtime for one command, and shut it down afterwards."""
    ray = _import_ray()
    if opts.address not in ("local", "auto"):
        _reachable(opts.address)
    level = logging.ERROR if report.quiet else logging.WARNING
    kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": level, "log_to_driver": not report.quiet}
    if opts.address == "local":
        replicas = opts.replicas or max(1, (os.cpu_count() or 2) - 1)
        import gencli

        root = str(Path(gencli.__file__).resolve().parents[1])  # the workers import this gencli
        path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
        kwargs.update(num_cpus=replicas + 1, runtime_env={"env_vars": {"PYTHONPATH": path, "RAY_USAGE_STATS_ENABLED": "0"}})
    else:
        kwargs["address"] = opts.address
    try:
        ray.init(**kwargs)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as exc:
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"--ray: cannot start or join Ray at '{opts.address}': {line}") from None
    try:
        res = ray.cluster_resources()
        cpus, gpus = float(res.get("CPU", 0)), float(res.get("GPU", 0))
        gpr = opts.gpus_per_replica
        if gpr is None:
            gpr = 1.0 if gpus >= 1 and device != "cpu" else 0.0
        if gpr > 0 and gpus < gpr:
            raise UserError(f"--gpus-per-replica {gpr:g}: the Ray cluster at '{opts.address}' has {gpus:g} GPUs")
        replicas = opts.replicas or (int(gpus // gpr) if gpr > 0 else max(1, int(cpus) - 1))
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = not report.quiet
        for name in ("ray", "ray.data"):
            logging.getLogger(name).setLevel(logging.ERROR if report.quiet else logging.WARNING)
        cluster = Cluster(cpus, gpus, replicas, gpr)
        report.debug(cluster.describe())
        yield cluster
    finally:
        ray.shutdown()


@contextlib.contextmanager
def ray_task_errors() -> Iterator[None]:
    """A UserError raised inside a Ray task (a file that cannot be read) is the command's error line."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - Ray wraps the task's exception
        cause = exc
        while cause is not None and not isinstance(cause, UserError):
            cause = getattr(cause, "cause", None) or cause.__cause__
        if isinstance(cause, UserError):
            raise UserError(str(cause)) from None
        raise


__all__ = [
    "ray_task_errors",
    "RayOptions",
    "Cluster",
    "check_options",
    "refuse",
    "refuse_without_ray",
    "check_out_dir",
    "prepare_out_dir",
    "shard_name",
    "ray_runtime",
    "CONNECT_TIMEOUT_S",
]
