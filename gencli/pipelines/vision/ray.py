"""The image commands with ``--ray`` (``classify``, ``zeroshot``, ``similarity``: any command that
predicts one value per image): the single-process loop, :func:`~gencli.pipelines.vision.images.predict_image_files`,
run by a pool of model replicas on the single-process batches.

The paths are cut into the single-process batches (``--batch-size`` consecutive paths; a model's
numerics depend on the composition of its batch, so the same batches give the same bytes), one
dataset row per batch; each replica loads the model once and predicts batch after batch. The driver
yields the results in input order as they come (Ray Data keeps the order), for the command's own
writer; with ``--out-dir`` each replica writes its batch as one JSON-lines shard instead.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from gencli.console import Reporter, emit_json, open_output
from gencli.pipelines.distributed.replica_warnings import ForwardedWarnings, ReplicaReporter
from gencli.pipelines.distributed.runtime import RayOptions, check_options, prepare_out_dir, ray_runtime, ray_task_errors, shard_name
from gencli.pipelines.vision.images import ImageResult, predict_image_files, result_record

Predict = Callable[[list], Sequence[Any]]
Record = Callable[[ImageResult], dict]
Warn = Callable[[str], None]


def _no_warning(message: str) -> None:
    pass


def classifier(model: str, top_k: int, warn: Warn = _no_warning, **load_options: Any) -> Predict:
    """Load an image classifier (in a replica) and return its batch ``predict``."""
    from gencli.pipelines.vision.classify import ImageClassifier

    clf = ImageClassifier.load(model, warn=warn, **load_options)
    return lambda images: clf.predict(images, top_k)


def zero_shot(model: str, labels: Sequence[str], templates: Optional[Sequence[str]], top_k: int, warn: Warn = _no_warning, **load_options: Any) -> Predict:
    """Load a CLIP model (in a replica), embed the labels once and return the zero-shot ``predict``."""
    from gencli.pipelines.clip import zeroshot as zs

    bundle = zs.load(model, warn=warn, **load_options)
    clf = zs.ZeroShotClassifier(bundle, labels, templates or zs.default_templates(bundle.path), warn=warn)
    return lambda images: clf.predict(images, top_k)


def similarity(model: str, texts: Sequence[str], warn: Warn = _no_warning, **load_options: Any) -> Predict:
    """Load a CLIP model (in a replica), embed the texts once and return the cosine scorer."""
    from gencli.pipelines.clip import zeroshot as zs
    from gencli.pipelines.clip.similarity import SimilarityScorer

    return SimilarityScorer(zs.load(model, warn=warn, **load_options), texts)


class ImageReplica:
    """One model replica: ``load(warn=...)`` once, then the single-process loop on each batch of
    paths. Its warnings go back with the batches (a ``warnings`` column) for the driver to show."""

    def __init__(self, load: Callable[..., Predict], record: Record, out_dir: Optional[str] = None):
        self.report = ReplicaReporter()
        with self.report.collecting():
            self.predict = load(warn=self.report.warn)
        self.record = record
        self.out_dir = out_dir

    def __call__(self, frame):
        import pandas as pd

        rows = []
        for index, paths_json in zip(frame["batch"].tolist(), frame["paths"].tolist()):
            paths = json.loads(paths_json)
            with self.report.collecting():
                results = list(predict_image_files(paths, self.predict, batch_size=len(paths)))
            if self.out_dir is not None:
                with open_output(str(Path(self.out_dir) / shard_name((index,), ".jsonl")), True) as fh:
                    for r in results:
                        emit_json(self.record(r), fh)
                results = [ImageResult(r.path, error=r.error) for r in results]  # the driver reports the errors
            rows.append({"batch": index, "results": pickle.dumps(results), "warnings": self.report.take()})
        return pd.DataFrame(rows)


def predict_images(
    paths: Sequence[str],
    load: Callable[..., Predict],
    ray_opts: RayOptions,
    report: Reporter,
    *,
    batch_size: int,
    record: Record = result_record,
    device: str = "auto",
    out: Optional[str] = None,
) -> Iterator[ImageResult]:
    """One :class:`ImageResult` per path, in input order, computed by Ray replicas (their values are
    None with ``--out-dir``: the shards hold them, one ``record(result)`` JSON line each; ``out`` is
    the command's ``--out``, exclusive with ``--out-dir``)."""
    check_options(ray_opts, out=out)
    batches = [{"batch": k, "paths": json.dumps(list(paths[i : i + batch_size]))} for k, i in enumerate(range(0, len(paths), batch_size))]
    with ray_runtime(ray_opts, report, device=device) as cluster, ray_task_errors():
        import ray.data

        out_dir = str(prepare_out_dir(ray_opts.out_dir).resolve()) if ray_opts.out_dir else None
        replica = {"load": load, "record": record, "out_dir": out_dir}
        ds = ray.data.from_items(batches, override_num_blocks=max(1, len(batches))).map_batches(
            ImageReplica, batch_size=1, batch_format="pandas", fn_constructor_kwargs=replica, **cluster.actor_pool()
        )
        forward = ForwardedWarnings(report)
        for row in ds.iter_rows():  # in input order (the runtime preserves it)
            forward(row["warnings"])
            yield from pickle.loads(row["results"])


__all__ = ["predict_images", "classifier", "zero_shot", "similarity", "ImageReplica"]
