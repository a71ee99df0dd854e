"""Ray Data: map_batches over a pool of actors, each holding one Runner (graphrun.ray).

    mapped = graphrun.ray.dataset_map(spec, ds)   # a Ray Dataset: id + one column per output

Each actor builds its Runner (model, buffers, captured graphs) once, then runs every Ray batch
it is handed as the file path runs a chunk: the same record checks (read/checks.py; a bad
record follows data.on_bad_record), the same padding to buckets and oversize handling
(Runner.run_rows). Rejects and statistics go to a Collector actor, so none is lost with the
actor that met it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import warnings

import numpy as np

from graphrun.base.errors import GraphrunError, InputError
from graphrun.base.extras import install_hint
from graphrun.scale.ray.columns import LINE_TEXT, ORDINAL
from graphrun.spec.keys import PipelineSpec


def need_ray():
    """The ray module, or one message naming the extra that brings it."""
    try:
        import ray
        import ray.data  # noqa: F401 - ray without its data extra has no ray.data
    except ImportError:
        raise GraphrunError(f"Ray Data is not installed; install it with: {install_hint('ray')}"
                            ) from None
    return ray


def dataset_map(spec: PipelineSpec, ds, *, workers: int | None = None, collector=None,
                file: str = "ray", duplicates: dict[int, str] | None = None,
                id_kind: tuple[str, object] | None = None):
    """ds mapped through graphrun: a Ray Dataset with an `id` column (data.id_field's value,
    else the record's ordinal in ds) and one column per output, in ds's order when the
    DataContext preserves order. ds holds one column per input (and the id field); a
    `graphrun_ordinal` column is added (ds.zip) when ds has none.

    workers: actors in the pool (default: one per GPU of the cluster for a cuda spec, else
    the CPUs but one). collector: a Collector that gathers the rejects and the actors'
    statistics; one is made when None and kept as the dataset's `graphrun_collector` (and
    the pool's size as `graphrun_workers`).
    file: the name rejects give as their place ("<file>[row 7]").
    duplicates: the records (by ordinal) to reject as duplicate ids, with the reason, as
    graphrun.read.stream.job_duplicates decides them for a file before Ray starts; None: each
    actor finds the duplicates among the records it is handed only. id_kind: the Parquet id
    column's one type (read.formats.parquet_id_kind), decided where the file is."""
    ray = need_ray()
    # the schema as known without running ds: a fetch would read the first block and cancel
    # the read tasks in flight, a race that can abort the driver inside Ray (graphrun's JSONL
    # source declares its ORDINAL column; a schema unknown here has none)
    if ORDINAL not in (ds.columns(fetch_if_missing=False) or []):
        ds = with_ordinals(ds)
    gpu = wants_gpu(spec, ray)
    workers = workers or default_workers(gpu, ray)
    collector = collector or Collector()
    resources = {"num_gpus": 1} if gpu else {"num_cpus": cpu_share(workers, ray)}
    mapped = ds.map_batches(
        BatchMapper, fn_constructor_args=(spec, collector.actor, file, gpu, duplicates, id_kind),
        batch_size=spec.data.batch_size, batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=workers), **resources)
    mapped.context.execution_options.preserve_order = True  # ids and outputs in ds's order
    mapped.graphrun_collector, mapped.graphrun_workers = collector, workers
    return mapped


def with_ordinals(ds):
    """ds with each record's ordinal as a column (a zip with range(count): the count is the
    Parquet metadata's, or one pass over other inputs)."""
    import ray.data

    ordinals = ray.data.range(ds.count()).rename_columns({"id": ORDINAL})
    with warnings.catch_warnings():  # zip's deprecation: order is preserved (dataset_map)
        warnings.simplefilter("ignore")
        return ds.zip(ordinals)


def wants_gpu(spec: PipelineSpec, ray) -> bool:
    """One GPU per actor for device cuda or cuda:N, and for auto on a cluster with GPUs."""
    if spec.device == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return spec.device.startswith("cuda")


def default_workers(gpu: bool, ray) -> int:
    res = ray.cluster_resources()
    if gpu:
        return max(1, int(res.get("GPU", 0)))
    return max(1, int(res.get("CPU", 1)) - 1)  # one CPU left for the read and write tasks


def cpu_share(workers: int, ray) -> float:
    """CPUs per CPU actor: one, or less where the pool would leave no CPU for Ray's read and
    write tasks (the pipeline then waits for a CPU that never comes free)."""
    cpus = ray.cluster_resources().get("CPU", 1)
    return min(1.0, max(cpus - 1, 0.5) / workers)


class BatchMapper:
    """One pool actor: a Runner built once, then Ray batch after Ray batch."""

    def __init__(self, spec: PipelineSpec, collector, file: str, gpu: bool,
                 duplicates: dict[int, str] | None = None,
                 id_kind: tuple[str, object] | None = None):
        import ray

        self.collector, self.ray = collector, ray
        with self.reported():
            self.setup(spec, file, gpu, duplicates, id_kind)

    @contextlib.contextmanager
    def reported(self):
        """A GraphrunError raised inside told to the Collector first: Ray's wrapping of an
        actor's exception does not keep it, and the driver reports it as the run's error."""
        try:
            yield
        except GraphrunError as err:
            self.ray.get(self.collector.fail.remote(str(err)))
            raise

    def setup(self, spec: PipelineSpec, file: str, gpu: bool,
              duplicates: dict[int, str] | None,
              id_kind: tuple[str, object] | None = None) -> None:
        from graphrun.engine import Runner
        from graphrun.read.checks import RecordChecker

        if gpu and spec.device != "auto":  # the actor sees its one GPU as cuda:0
            spec = spec.model_copy(update={"device": "cuda:0"})
        self.spec, self.file = spec, file
        self.key = f"{socket.gethostname()}:{os.getpid()}"
        said: list[str] = []
        self.runner = Runner(spec, log=lambda msg: said.append(msg[len("warning: "):])
                             if msg.startswith("warning: ") else None)
        self.checker = RecordChecker(spec, duplicates, id_kind)
        r = self.runner
        self.ray.get(self.collector.setup.remote(self.key, {
            "host": socket.gethostname(), "pid": os.getpid(), "device": str(r.device),
            "backend": r.backend, "setup_s": r.setup_s, "warnings": said}))

    def __call__(self, table):
        with self.reported():
            return self.run_table(table)

    def candidates(self, table):
        """A Ray batch as the records one process reads: JSONL lines parsed (ray/jsonl.py),
        or columns (Parquet, .npy, a Dataset from Python) located by row."""
        from graphrun.read.formats.parquet_columns import parquet_candidates
        from graphrun.read.records import RowWhere
        from graphrun.scale.ray.jsonl import line_candidates

        if LINE_TEXT in table.column_names:
            return line_candidates(self.spec, self.file, table)
        ordinals = table.column(ORDINAL).to_numpy().astype(np.int64)
        rb = plain_columns(table.drop_columns([ORDINAL]).combine_chunks().to_batches()[0])
        c = parquet_candidates(self.spec, self.file, rb, int(ordinals[0]))
        c.indices, c.where = ordinals, RowWhere(self.file, ordinals)
        return c

    def run_table(self, table):
        if table.num_rows == 0:
            return output_table(self.spec, [], {}, 0)
        t0 = time.perf_counter()
        checked = self.checker.check(self.candidates(table))
        if checked.rejects and self.spec.data.on_bad_record == "error":
            bad = checked.rejects[0]
            raise InputError(f"{bad.reason}; fix the record, or set data.on_bad_record: skip "
                             "to collect such records in rejects.jsonl and go on",
                             where=bad.where, record_id=bad.id)
        n = len(checked)
        outs, ran = (self.runner.launcher.run_rows(checked.fields, n, checked.lengths) if n
                     else ({}, []))
        times = [(b.name if b else "oversize-eager", t) for b, t in ran]
        rejects = [{"index": r.index, "id": plain_id(r.id), "where": r.where,
                    "reason": r.reason} for r in checked.rejects]
        buckets = [b.model_dump() for b in self.runner.bucket_reports()]
        self.ray.get(self.collector.batch.remote(
            self.key, n, rejects, times, buckets, time.perf_counter() - t0))
        return output_table(self.spec, checked.ids, outs, n)


def plain_columns(rb):
    """Ray's tensor columns (read_numpy's, an ndarray column's) as nested lists, the layout the
    Parquet path reads."""
    import pyarrow as pa

    from graphrun.write.sinks.parquet import arrow_column

    if not any(isinstance(t, pa.ExtensionType) for t in rb.schema.types):
        return rb
    columns = [arrow_column(list(c.to_numpy())) if isinstance(c.type, pa.ExtensionType) else c
               for c in rb.columns]
    return pa.RecordBatch.from_arrays(columns, names=rb.schema.names)


def plain_id(rid):
    return rid.item() if isinstance(rid, np.generic) else rid


def output_table(spec: PipelineSpec, ids, outs: dict, n: int):
    """id + one column per output, as the Parquet sink lays them out (write/sinks/parquet.py)."""
    import pyarrow as pa

    from graphrun.write.sinks.parquet import arrow_column

    ids = ids.tolist() if isinstance(ids, np.ndarray) else [plain_id(i) for i in ids]
    columns = {"id": pa.array(ids)}
    for name in spec.outputs:
        columns[name] = arrow_column(list(outs[name])) if n else pa.array([], pa.null())
    return pa.table(columns)


class Collector:
    """The rejects and statistics of every actor of a dataset_map, held by one small Ray
    actor (no CPU reserved) so that they outlive the pool. Read them once the dataset ran."""

    def __init__(self):
        ray = need_ray()
        self.actor = ray.remote(num_cpus=0)(CollectorState).remote()
        self.ray = ray

    def rejects(self) -> list[dict]:
        """Every rejected record, in input order: index, id, where, reason."""
        return self.ray.get(self.actor.rejects.remote())

    def failure(self) -> str | None:
        """The first GraphrunError an actor raised, as text (None: none did)."""
        return self.ray.get(self.actor.failure.remote())

    def stats(self) -> dict:
        """Per actor: host, pid, device, backend, setup_s, batches, records, rejected, busy_s,
        buckets (its Runner's bucket reports); per bucket: phase -> the batches' times (us)."""
        return self.ray.get(self.actor.stats.remote())


class CollectorState:
    """The Collector's actor body."""

    def __init__(self):
        self.actors: dict[str, dict] = {}
        self.reject_rows: list[dict] = []
        self.samples: dict[str, dict[str, list[float]]] = {}
        self.error: str | None = None

    def setup(self, key: str, info: dict) -> None:
        self.actors[key] = {**info, "batches": 0, "records": 0, "rejected": 0, "busy_s": 0.0,
                            "buckets": []}

    def batch(self, key: str, n: int, rejects: list, times: list, buckets: list,
              busy_s: float) -> None:
        a = self.actors[key]
        a["batches"] += len(times)
        a["records"] += n
        a["rejected"] += len(rejects)
        a["busy_s"] += busy_s
        a["buckets"] = buckets  # the Runner's counts so far
        self.reject_rows.extend(rejects)
        for name, phases in times:
            for phase, us in phases.items():
                self.samples.setdefault(name, {}).setdefault(phase, []).append(us)

    def fail(self, message: str) -> None:
        self.error = self.error or message

    def failure(self) -> str | None:
        return self.error

    def rejects(self) -> list[dict]:
        return sorted(self.reject_rows, key=lambda r: r["index"])

    def stats(self) -> dict:
        return {"actors": self.actors, "samples": self.samples}
