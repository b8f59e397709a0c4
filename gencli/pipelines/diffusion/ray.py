"""``txt2img --prompts-file`` with ``--ray``: the single-process batches of images (consecutive jobs
with the same settings, ``--batch-size`` at a time: the seeds, settings and output names planned by
the driver exactly as in the single process), one dataset row per batch, made by a pool of replicas
that each load the pipeline once and write the PNGs themselves. The driver gets each image's JSON
record back, in job order.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from gencli.console import Reporter
from gencli.pipelines.distributed.replica_warnings import ForwardedWarnings, ReplicaReporter
from gencli.pipelines.distributed.runtime import RayOptions, check_options, ray_runtime, ray_task_errors


class DiffusionReplica:
    """One replica: load the pipeline once, then make and write each batch of images."""

    def __init__(self, load: Callable[[], Any], force: bool):
        self.report = ReplicaReporter()  # the Python warnings raised here go back with the batches
        with self.report.collecting():
            self.pipe = load()
        self.force = force

    def __call__(self, frame):
        import pandas as pd

        from gencli.pipelines.diffusion.jobs import run_jobs, write_image

        rows = []
        for index, group_bytes, cwd in zip(frame["batch"].tolist(), frame["jobs"].tolist(), frame["cwd"].tolist()):
            group = pickle.loads(group_bytes)
            with self.report.collecting():
                records = [
                    write_image(job, image, self.pipe, force=self.force, to=Path(cwd) / job.out)
                    for job, image in run_jobs(self.pipe, group, batch_size=len(group))
                ]
            rows.append({"batch": index, "records": pickle.dumps(records), "warnings": self.report.take()})
        return pd.DataFrame(rows)


def make_images(
    jobs: Sequence[Any], load: Callable[[], Any], ray_opts: RayOptions, report: Reporter, *, batch_size: int, force: bool, device: str = "auto"
) -> Iterator[dict]:
    """The JSON record of each image (:func:`~gencli.pipelines.diffusion.jobs.write_image`), in job
    order, the PNGs written by Ray replicas to the jobs' output names (relative names resolved
    against this directory)."""
    from gencli.pipelines.diffusion.jobs import batches

    check_options(ray_opts)
    cwd = str(Path.cwd())
    rows = [{"batch": k, "jobs": pickle.dumps(group), "cwd": cwd} for k, group in enumerate(batches(jobs, batch_size))]
    with ray_runtime(ray_opts, report, device=device) as cluster, ray_task_errors():
        import ray.data

        ds = ray.data.from_items(rows, override_num_blocks=max(1, len(rows))).map_batches(
            DiffusionReplica, batch_size=1, batch_format="pandas", fn_constructor_kwargs={"load": load, "force": force}, **cluster.actor_pool()
        )
        forward = ForwardedWarnings(report)
        for row in ds.iter_rows():  # in job order (the runtime preserves it)
            forward(row["warnings"])
            yield from pickle.loads(row["records"])


__all__ = ["make_images", "DiffusionReplica"]
