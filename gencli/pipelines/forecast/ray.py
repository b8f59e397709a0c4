"""``gencli forecast --ray``: the forecast of many series on a Ray cluster, identical to the
single-process run.

1. The driver lists the input (a file, a directory of files or a glob; sorted by name), infers the
   layout from the first file and loads the model once to settle the horizon and context exactly as
   :func:`gencli.pipelines.forecast.pipeline.prepare` does for one process.
2. One Ray task per file reads and parses it with the single-process reader and yields one row per
   series (its validated record, or why it was skipped). With several files the rows of one id are
   merged first (a ``groupby`` on the id), so a series is never split across replicas.
3. An actor pool (``map_batches``, ``--replicas``; each replica loads the model once) forecasts the
   series ``--batch-size`` at a time with the single-process ``forecast_batches``.
4. The driver puts the results in input order (input file, then first appearance in it: the
   single-process order) and writes them with the single-process writer, so the CSV/JSON output, the
   plot and the explanations are the same bytes; or, with ``--out-dir``, each replica writes its
   batch as one shard (CSV, or JSON lines with ``--json``; shard names sort in input order).
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import pickle
from pathlib import Path
from typing import Any, Iterator, Optional

from gencli.console import Reporter, open_output
from gencli.errors import UserError
from gencli.pipelines.distributed.replica_warnings import ForwardedWarnings, ReplicaReporter
from gencli.pipelines.distributed.runtime import Cluster, RayOptions, check_options, prepare_out_dir, ray_runtime, ray_task_errors, refuse, shard_name
from gencli.pipelines.forecast.layout import Layout
from gencli.pipelines.forecast.outputs import imputed_note
from gencli.pipelines.forecast.pipeline import Failures, RunState, Setup, forecast_batches, load_forecaster, prepare, write_forecasts
from gencli.pipelines.forecast.records import RecordOptions, SeriesError, build_record
from gencli.pipelines.forecast.request import ForecastRequest, check_request
from gencli.pipelines.forecast.table import iter_groups, open_table

DATA_SUFFIXES = (".csv", ".tsv", ".tab", ".txt", ".parquet", ".pq", ".gz", ".bz2", ".zip", ".xz")


def input_files(data: str) -> list[Path]:
    """The files of ``DATA``: one file, the data files of a directory, or a glob; sorted by name."""
    if data == "-":
        raise UserError("--ray cannot honour stdin ('-'): the workers read files; save the table to a file (or a directory of files)")
    if any(ch in data for ch in "*?["):
        files = sorted(Path(f) for f in glob.glob(data, recursive=True) if Path(f).is_file())
        if not files:
            raise UserError(f"'{data}' matches no files")
        return files
    p = Path(data).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith((".", "_")) and f.name.lower().endswith(DATA_SUFFIXES))
        if not files:
            raise UserError(f"'{data}' holds no CSV or Parquet files")
        return files
    if not p.exists():
        raise UserError(f"'{data}' does not exist")
    return [p]


def _unsupported(req: ForecastRequest, ray_opts: RayOptions) -> None:
    refuse([("--backtest", req.backtest), ("--fit-steps", req.fit_steps), ("--save-model", req.save_model)], "it needs every series in one process")
    if ray_opts.out_dir:
        refuse([("--plot", req.plot), ("--explain", req.explain), ("--explain-out", req.explain_out)], "with --out-dir the replicas write the results")


# -- the stages (run by Ray workers) ---------------------------------------------------------------------
def _series_row(file_index: int, position: int, sid: str, **payload: Any) -> dict[str, Any]:
    row = {"file_index": file_index, "position": position, "id": sid, "record": b"", "frame": b"", "error": "", "warnings": "[]"}
    row.update(payload)
    return row


def _built(file_index: int, position: int, sid: str, frame, layout: Layout, rec_opts: RecordOptions) -> dict[str, Any]:
    try:
        return _series_row(file_index, position, sid, record=pickle.dumps(build_record(sid, frame, layout, rec_opts)))
    except SeriesError as exc:
        return _series_row(file_index, position, sid, error=str(exc))


def read_series(row: dict[str, Any], *, layout: Layout, rec_opts: RecordOptions, merge: bool) -> list[dict[str, Any]]:
    """One input file as rows, one per series in first-appearance order: its record (or why it was
    skipped), or with ``merge`` its frame, for :func:`merge_series` to join with the other files' rows.
    The reader's warnings travel on the file's first row."""
    table = open_table(row["file"])
    fi = int(row["file_index"])
    out = []
    reader = ReplicaReporter()
    with reader.collecting():
        for i, (sid, frame) in enumerate(iter_groups(table, layout, reader.warn)):
            out.append(_series_row(fi, i, sid, frame=pickle.dumps(frame)) if merge else _built(fi, i, sid, frame, layout, rec_opts))
    if out:
        out[0]["warnings"] = reader.take()
    return out


def merge_series(group, *, layout: Layout, rec_opts: RecordOptions):
    """The rows of one id from several files (a pandas group) as one series, placed where it first appears."""
    import pandas as pd

    group = group.sort_values(["file_index", "position"])
    frame = pd.concat([pickle.loads(b) for b in group["frame"]], ignore_index=True)
    first = group.iloc[0]
    row = _built(int(first["file_index"]), int(first["position"]), str(first["id"]), frame, layout, rec_opts)
    row["warnings"] = json.dumps([m for w in group["warnings"] for m in json.loads(w)])
    return pd.DataFrame([row])


class ForecastReplica:
    """One model replica of the actor pool: loads the model once, then forecasts batch after batch.
    Its warnings travel on the first row of the batch they were raised in (the ``warnings`` column)."""

    def __init__(self, req: ForecastRequest, model: str, binding, horizon: int, context: int, out_dir: Optional[str] = None, time_zone=None):
        self.report = ReplicaReporter(json=req.json)
        with self.report.collecting():
            fc = load_forecaster(req, Path(model))
        self.run = RunState(req, self.report, fc, binding, horizon, context, None, None, {}, time_zone)
        self.out_dir = out_dir

    def __call__(self, frame) -> dict:
        batch = {k: frame[k].tolist() for k in ("file_index", "position", "id", "error", "warnings")}
        with self.report.collecting():
            results = [r for part in forecast_batches(self.run, [pickle.loads(b) for b in frame["record"]]) for r in part]
            batch["imputed"] = [r.record.imputed for r in results]
            if self.out_dir is None:
                batch["result"] = [pickle.dumps(r) for r in results]
            else:
                self._write_shard(batch, results)
        raised = json.loads(self.report.take())
        if raised:
            batch["warnings"][0] = json.dumps(json.loads(batch["warnings"][0]) + raised)
        return batch

    def _write_shard(self, batch: dict, results: list) -> None:
        """This batch's results as one shard, written as the single-process run writes them (the
        skipped series are reported by the driver)."""
        from gencli.pipelines.forecast.outputs import ForecastWriter

        run = self.run
        suffix = ".jsonl" if run.req.json else ".csv"
        path = Path(self.out_dir) / shard_name((batch["file_index"][0], batch["position"][0]), suffix)
        # a retried batch rewrites its own shard (same name, same content)
        with contextlib.ExitStack() as stack, open_output(str(path), True, newline="") as fh:
            writer = ForecastWriter(run.req, run.report, run.fc.grid, run.horizon, run.context, stack, fh, time_zone=run.time_zone)
            for res in results:
                writer.write(res)


# -- the driver ----------------------------------------------------------------------------------------------
def run(req: ForecastRequest, ray_opts: RayOptions, report: Reporter) -> None:
    """``gencli forecast --ray``: the single-process :func:`~gencli.pipelines.forecast.pipeline.run`,
    with the series read, validated and forecast by Ray workers."""
    check_request(req)
    check_options(ray_opts, out=req.out)
    _unsupported(req, ray_opts)
    files = input_files(req.data)
    setup = prepare(req, report, open_table(str(files[0])))
    if setup.layout.wide and len(files) > 1:
        raise UserError("--ray reads a wide table (one series per column) from one file only: pass a single file")
    with ray_runtime(ray_opts, report, device=req.device) as cluster, ray_task_errors():
        rows = _forecast_rows(req, ray_opts, setup, files, cluster)
    rows.sort(key=lambda r: (int(r["file_index"]), int(r["position"])))
    forward = ForwardedWarnings(report)
    for r in rows:
        forward(r["warnings"])
    if ray_opts.out_dir:
        _report_sharded(req, ray_opts, report, setup, rows)
        return
    positions = {str(r["id"]): i for i, r in enumerate(rows)}
    with open_output(req.out, req.force, newline="") as results:
        failures = Failures(report, results)
        for i, r in enumerate(rows):
            if r["error"]:
                failures.add(str(r["id"]), str(r["error"]), i)
        state = RunState(req, report, setup.fc, setup.binding, setup.horizon, setup.context, failures, results, positions, setup.layout.time_zone)
        write_forecasts(state, _in_batches([pickle.loads(r["result"]) for r in rows if not r["error"]], req.batch_size), None)


def _forecast_rows(req: ForecastRequest, ray_opts: RayOptions, setup: Setup, files: list[Path], cluster: Cluster) -> list[dict[str, Any]]:
    import ray.data
    from ray.data.expressions import col

    merge = len(files) > 1
    items = [{"file": str(f.resolve()), "file_index": i} for i, f in enumerate(files)]
    kw = {"layout": setup.layout, "rec_opts": setup.record_options}
    ds = ray.data.from_items(items, override_num_blocks=len(items)).flat_map(read_series, fn_kwargs={**kw, "merge": merge})
    if merge:
        # one row per series, back in input order (where each first appears): the single-process order
        ds = ds.groupby("id").map_groups(merge_series, batch_format="pandas", fn_kwargs=kw).sort(["file_index", "position"])
    ds = ds.materialize()  # read once: the skipped series go to the driver, the others to the replicas
    skipped = ds.filter(expr=col("error") != "").select_columns(["file_index", "position", "id", "error", "warnings"]).take_all()
    # the model batches are the single-process ones (--batch-size series in input order): the
    # numerics of a batch depend on its composition, so the same batches give the same bytes
    ds = ds.filter(expr=col("error") == "").repartition(target_num_rows_per_block=req.batch_size)
    out_dir = str(prepare_out_dir(ray_opts.out_dir).resolve()) if ray_opts.out_dir else None
    ds = ds.map_batches(
        ForecastReplica, batch_size=req.batch_size, batch_format="pandas",
        fn_constructor_kwargs={
            "req": req, "model": str(setup.fc.path), "binding": setup.binding, "horizon": setup.horizon, "context": setup.context, "out_dir": out_dir,
            "time_zone": setup.layout.time_zone,
        },
        **cluster.actor_pool(),
    )  # fmt: skip
    return [{**r, "imputed": 0, "result": b""} for r in skipped] + ds.take_all()


def _in_batches(results: list, size: int) -> Iterator[list]:
    for i in range(0, len(results), size):
        yield results[i : i + size]


def _report_sharded(req: ForecastRequest, ray_opts: RayOptions, report: Reporter, setup: Setup, rows: list[dict[str, Any]]) -> None:
    """``--out-dir``: the shards are written; the failures (warnings; JSON error records are in the
    shards), the imputation note and the closing line go to stderr."""
    failures = Failures(report, io.StringIO())
    for i, r in enumerate(rows):
        if r["error"]:
            failures.add(str(r["id"]), str(r["error"]), i)
    done = sum(1 for r in rows if not r["error"])
    failures.finish(done, req.strict)
    imputed = [(str(r["id"]), int(r["imputed"])) for r in rows if int(r["imputed"])]
    if imputed:
        report.say(imputed_note(imputed))
    shards = len(list(Path(ray_opts.out_dir).glob("part-*")))
    skipped = f"; {len(failures.items)} skipped" if failures.items else ""
    report.log(f"forecast {done} series x {setup.horizon} steps{skipped} -> {shards} shards in {ray_opts.out_dir}")


__all__ = ["run", "input_files", "read_series", "merge_series", "ForecastReplica"]
