"""Data path: records/s of the whole `graphrun run` against the back-to-back replay rate of the
same graphs, serial path against overlapped, per input format.

    python3 benchmarks/bench_datapath.py [--models decoder,mlp]
        [--formats jsonl,npy,parquet,parquet-out]
        [--records 1000000] [--jsonl-records 200000] [--records-decoder 20000]
        [--decoder-head logits|greedy] [--decoder-batch 32] [--parquet-row-group 65536]
        [--repeat N] [--workdir DIR] [--out FILE] [--smoke]

Models (bf16 on CUDA; tiny and float32 with --smoke or on a CPU):
  decoder  builtin decoder 12 layers x 768, 12 heads, vocab 32000 (--decoder-vocab), KV cache
           512; batch 32 (--decoder-batch B: buckets [1, 8, 32, B]); inputs tokens [1] +
           positions, so its "npy" input is an uncompressed .npz (a .npy holds one array);
           outputs its logits, or with --decoder-head greedy the next token (argmax in the graph)
  mlp      builtin mlp, in 256, hidden 1024, 24 layers, out 16; batch 1024, buckets [1, 64, 1024]
Per model, one input file per format is written into --workdir from the same values (the MLP's
rounded to 3 decimals, so JSONL holds them exactly), then for each format (outputs written as
npy shards; parquet-out: the Parquet input, outputs written as Parquet shards):
  read-only   records/s of one pass of read_batches alone (parse, check, batch; no model)
  write-only  records/s of the ShardWriter alone, fed the model's output shapes in batches
              (shard commits included: sha256 and fsync), once per model
  serial      graphrun.run(spec, overlap=False): manifest.totals.records_per_s
  overlapped  graphrun.run(spec, overlap=True), likewise, with device idle fraction and
              host_phase_s (where each thread's streaming time went)
and once per model, on a Runner built from the same spec with its host staging filled once
from the file's first batch:
  replay-only    the batch bucket's graph replayed back to back, one synchronize at the end
  device path    launch (h2d + replay + d2h, the two host slots alternating) back to back,
                 one wait at the end: the most the data path can feed the device
  launch+collect launch then collect (wait, cut the rows) per batch: a loop without overlap
The decoder's outputs are its full logits, 32000 float32 per record (128 KB): 1M records would
be 128 GB, so it reads --records-decoder records (default 20,000: 2.6 GB of outputs) and writes
shards of --rows-per-file-decoder rows, so shard commits (sha256, fsync) happen while streaming
as they would in a long run. JSONL parsing runs at tens of thousands of 256-float records/s, so
the MLP's JSONL file has --jsonl-records records (default 200,000), not 1M: 50 s a pass saved.
Outputs are deleted after each run; the same values must give the same outputs, so each run's
shards are compared with those of the run with the most records: sha256 of every shard, and
where they differ the largest difference over a sample of rows.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.compute  # noqa: F401 - imported before any timing (pyarrow loads it lazily)
import pyarrow.parquet  # noqa: F401
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import graphrun  # noqa: E402
from graphrun.base.cores import usable_cores  # noqa: E402
from graphrun.engine import Runner  # noqa: E402
from graphrun.base.tuning import Tuning  # noqa: E402 - the reader's settings
from graphrun.spec.keys import PipelineSpec  # noqa: E402
from graphrun.read.stream import read_batches  # noqa: E402

FORMATS = ("jsonl", "npy", "parquet", "parquet-out")
OUT_FORMAT = {"parquet-out": "parquet"}  # the runs' output.format: npy unless named here
IN_FORMAT = {"parquet-out": "parquet"}  # the input file a format reads: its own unless here
WRITE_CHUNK = 65536  # records generated and written at a time (bounded memory while writing)
# records per Parquet row group (--parquet-row-group; None: pyarrow's default, up to 1Mi)
PARQUET_ROW_GROUP: int | None = 65536
RTOL = ATOL = 2e-2  # bf16 logits, as bench_capture.py


# -- the models -----------------------------------------------------------------------------

@dataclass
class Case:
    name: str
    args: dict
    batch: int
    buckets: list
    records: int
    rows_per_file: int
    dtype: str  # model dtype
    jsonl_records: int | None = None  # fewer records in the JSONL file (its parsing is slow)
    out_dtype: str | None = None  # outputs.<name>.dtype (None: the model's, float32 on the host)
    greedy: bool = False  # decoder: the next token (argmax inside the graph), not the logits

    def records_in(self, fmt: str) -> int:
        return min(self.records, self.jsonl_records or self.records) if fmt == "jsonl" \
            else self.records

    @property
    def decoder(self) -> bool:
        return self.name == "decoder"

    def suffix(self, fmt: str) -> str:
        # the decoder has two inputs: its dense-array file is a (stored) .npz
        return ".npz" if fmt == "npy" and self.decoder else f".{fmt}"

    def spec(self, data: Path, out: Path, device: str, out_format: str = "npy"
             ) -> PipelineSpec:
        a = self.args
        if self.decoder:
            inputs = {"tokens": {"shape": ["batch", 1], "dtype": "int64",
                                 "range": [0, a["vocab"]]},
                      "positions": {"shape": ["batch"], "dtype": "int64",
                                    "range": [0, a["max_len"]]}}
            outputs = ({"next_token": {"shape": ["batch", 1], "reduce": ["argmax"]}}
                       if self.greedy else
                       {"logits": {"shape": ["batch", 1, a["vocab"]], "dtype": self.out_dtype}})
        else:
            # numpy has no bfloat16: bf16 inputs are read as float32 and cast on the device
            inputs = {"x": {"shape": ["batch", a["in_features"]], "dtype": self.dtype}}
            outputs = {"scores": {"shape": ["batch", a["out_features"]]}}
        cuda = device != "cpu"
        return PipelineSpec.model_validate({
            "version": 1, "name": f"datapath-{self.name}", "device": device,
            "model": {"builtin": self.name, "args": a, "dtype": self.dtype},
            "inputs": inputs, "outputs": outputs,
            "buckets": {"batch": self.buckets},
            "capture": {"backend": "cuda-graph" if cuda else "eager", "warmup_iters": 3,
                        "verify": {"enabled": True, "rtol": RTOL, "atol": ATOL}},
            "data": {"path": str(data), "batch_size": self.batch},
            "output": {"dir": str(out), "format": out_format,
                       "rows_per_file": self.rows_per_file},
        })


# manifest.totals.host_phase_s, by thread: stager, launching thread, completer
PHASES = ("read", "stage", "read_wait", "launch", "device_wait", "write")


def make_cases(args, cuda: bool) -> dict[str, Case]:
    tiny = args.smoke or not cuda
    dtype = "bfloat16" if cuda else "float32"
    if tiny:
        dec = {"layers": 2, "d_model": 64, "heads": 4, "vocab": 512, "max_len": 64}
        mlp = {"in_features": 32, "hidden": 64, "layers": 2, "out_features": 16}
    else:
        dec = {"layers": 12, "d_model": 768, "heads": 12, "vocab": args.decoder_vocab,
               "max_len": 512}
        mlp = {"in_features": 256, "hidden": 1024, "layers": 24, "out_features": 16}
    return {
        "decoder": Case("decoder", dec, args.decoder_batch,
                        sorted({1, 8, 32, args.decoder_batch}), args.records_decoder,
                        args.rows_per_file_decoder, dtype, out_dtype=args.logits_dtype,
                        greedy=args.decoder_head == "greedy"),
        "mlp": Case("mlp", mlp, 1024, [1, 64, 1024], args.records, 100_000, dtype,
                    args.jsonl_records),
    }


# -- input files: the same values in every format -------------------------------------------

def chunk_values(case: Case, lo: int, hi: int) -> dict[str, np.ndarray]:
    """Records [lo, hi), seeded by position: never zeros, the same whichever chunking."""
    rng = np.random.default_rng([7, lo])
    n = hi - lo
    if case.decoder:
        return {"tokens": rng.integers(0, case.args["vocab"], (n, 1), dtype=np.int64),
                "positions": rng.integers(0, case.args["max_len"], n, dtype=np.int64)}
    # codes in [-9999, 9999]: the value code / 1000 has an exact 3-decimal text form
    codes = np.clip(np.rint(rng.standard_normal((n, case.args["in_features"])) * 1000),
                    -9999, 9999).astype(np.int32)
    return {"codes": codes}


def mlp_floats(codes: np.ndarray) -> np.ndarray:
    return (codes / 1000.0).astype(np.float32)


_CODE_TEXT = np.frombuffer("".join(f"{c / 1000:6.3f}" for c in range(-9999, 10000))
                           .encode(), np.uint8).reshape(-1, 6)  # fixed width: "-1.234", " 0.5"


def jsonl_lines(case: Case, values: dict) -> bytes:
    if case.decoder:
        return "".join(f'{{"tokens":[{t}],"positions":{p}}}\n' for t, p in
                       zip(values["tokens"][:, 0].tolist(), values["positions"].tolist())).encode()
    # vectorized: each value as 6 fixed-width characters and a comma, the last comma a ']'
    codes = values["codes"]
    n, width = codes.shape
    text = np.empty((n, width, 7), np.uint8)
    text[:, :, :6] = _CODE_TEXT[codes + 9999]
    text[:, :, 6] = ord(",")
    text = text.reshape(n, width * 7)
    text[:, -1] = ord("]")
    head = np.broadcast_to(np.frombuffer(b'{"x":[', np.uint8), (n, 6))
    tail = np.broadcast_to(np.frombuffer(b"}\n", np.uint8), (n, 2))
    return np.hstack([head, text, tail]).tobytes()


def write_inputs(case: Case, n: int, workdir: Path, formats: list[str],
                 jsonl_n: int | None = None) -> dict[str, Path]:
    """n records in each format (jsonl_n in the JSONL file), the same values in each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl_n = n if jsonl_n is None else min(n, jsonl_n)
    paths = {fmt: workdir / f"{case.name}-{jsonl_n if fmt == 'jsonl' else n}{case.suffix(fmt)}"
             for fmt in formats}
    dense_tmp = {}
    if "npy" in formats:  # written as .npy members, zipped (stored) for the decoder
        if case.decoder:
            shapes = {"tokens": ((n, 1), np.int64), "positions": ((n,), np.int64)}
        else:
            shapes = {"x": ((n, case.args["in_features"]), np.float32)}
        for name, (shape, dtype) in shapes.items():
            tmp = workdir / f".{case.name}.{name}.npy"
            dense_tmp[name] = (tmp, np.lib.format.open_memmap(tmp, "w+", dtype, shape))
    jsonl = open(paths["jsonl"], "wb") if "jsonl" in formats else None
    parquet, pending = None, []
    for lo in range(0, n, WRITE_CHUNK):
        hi = min(lo + WRITE_CHUNK, n)
        values = chunk_values(case, lo, hi)
        arrays = values if case.decoder else {"x": mlp_floats(values["codes"])}
        for name, (_, mm) in dense_tmp.items():
            mm[lo:hi] = arrays[name]
        if jsonl and lo < jsonl_n:
            jsonl.write(jsonl_lines(case, {k: v[:jsonl_n - lo] for k, v in values.items()}))
        if "parquet" in formats:
            cols = {}
            for name, a in arrays.items():
                if a.ndim == 1:
                    cols[name] = pa.array(a)
                else:  # list<...> columns, as pandas and most tools write them
                    offsets = pa.array(np.arange(0, a.size + 1, a.shape[1], dtype=np.int32))
                    cols[name] = pa.ListArray.from_arrays(offsets, pa.array(a.reshape(-1)))
            table = pa.table(cols)
            if parquet is None:
                parquet = pq.ParquetWriter(paths["parquet"], table.schema)
            pending.append(table)  # written by the row group: a row group per write_table
            if hi == n or sum(len(t) for t in pending) >= (PARQUET_ROW_GROUP or 1 << 20):
                parquet.write_table(pa.concat_tables(pending),
                                    row_group_size=PARQUET_ROW_GROUP)
                pending.clear()
    if jsonl:
        jsonl.close()
    if parquet:
        parquet.close()
    for _, mm in dense_tmp.values():
        mm.flush()
    if dense_tmp:
        if case.decoder:
            import zipfile
            with zipfile.ZipFile(paths["npy"], "w", zipfile.ZIP_STORED) as zf:
                for name, (tmp, _) in dense_tmp.items():
                    zf.write(tmp, f"{name}.npy")
                    tmp.unlink()
        else:
            os.replace(dense_tmp["x"][0], paths["npy"])
    return paths


# -- measuring ------------------------------------------------------------------------------

@dataclass
class RunResult:
    rate: float
    records: int
    idle: float | None
    host: dict
    setup_s: float
    wall_s: float
    hashes: list
    warnings: list
    sample: dict  # output name -> every step-th row of the outputs


@dataclass
class Row:
    model: str
    fmt: str
    records: int = 0
    mib: float = 0.0
    read_rate: float | None = None
    serial: RunResult | None = None
    overlapped: RunResult | None = None
    error: str = ""


@dataclass
class ReplayRates:
    write: float = 0.0  # records/s of the ShardWriter alone
    graph: float = 0.0  # records/s
    device_path: float = 0.0
    launch_collect: float = 0.0
    step_us: float = 0.0
    note: str = ""


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    replay: dict[str, ReplayRates] = field(default_factory=dict)
    timings: list[tuple[str, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def read_rate(spec: PipelineSpec) -> tuple[int, float]:
    """One pass of read_batches alone: parse, check and batch, no model."""
    t0 = time.perf_counter()
    n = sum(len(b) for b in read_batches(spec))
    return n, n / (time.perf_counter() - t0)


def write_rate(case: Case, spec: PipelineSpec, out: Path, records: int) -> float:
    """The ShardWriter alone, as the run drives it: batches of real rows of the model's
    output shapes, ids = ordinals. Shard commits on the way are timed, the final close not
    (as in manifest.totals.records_per_s)."""
    from graphrun.write.shards import ShardWriter

    rng = np.random.default_rng(0)
    shapes = {name: [d for d in o.shape[1:]] for name, o in spec.outputs.items()}
    pool = [{name: rng.standard_normal((case.batch, *dims), dtype=np.float32)
             for name, dims in shapes.items()} for _ in range(4)]  # distinct batches, cycled
    shutil.rmtree(out, ignore_errors=True)
    writer = ShardWriter(spec, out)
    t0 = time.perf_counter()
    for k, lo in enumerate(range(0, records, case.batch)):
        hi = min(lo + case.batch, records)
        writer.write(np.arange(lo, hi), list(range(lo, hi)),
                     {name: a[:hi - lo] for name, a in pool[k % len(pool)].items()})
    seconds = time.perf_counter() - t0
    writer.close()
    shutil.rmtree(out, ignore_errors=True)
    return records / seconds


def run_pipeline(spec: PipelineSpec, out: Path, overlap: bool, step: int = 1) -> RunResult:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    manifest = graphrun.run(spec, out=out, overwrite=True, overlap=overlap)
    wall = time.perf_counter() - t0
    t = manifest.totals
    sample = sample_outputs(out, [f.path for f in manifest.files], step)
    shutil.rmtree(out, ignore_errors=True)  # the decoder's logits are GBs
    if manifest.status != "completed" or t.records_out != t.records_in:
        raise RuntimeError(f"run {manifest.status}: {t.records_out} of {t.records_in} records "
                           f"out, {t.records_rejected} rejected")
    return RunResult(t.records_per_s, t.records_out, t.device_idle_fraction,
                     dict(t.host_phase_s), t.setup_s, wall,
                     [(f.path, f.sha256) for f in manifest.files], list(manifest.warnings),
                     sample)


def sample_outputs(out: Path, files: list[str], step: int) -> dict[str, np.ndarray]:
    """Rows 0, step, 2 step, ... of each output, across the npy or Parquet shards in order."""
    shards: dict[str, dict[str, Path]] = {}  # "part-00000" -> output name -> file
    for name in files:
        if name.endswith(".parquet"):
            shards.setdefault(name.split(".")[0], {})["*"] = out / name
            continue
        stem, output, suffix = name.split(".", 2)
        if suffix == "npy" and output != "ids":
            shards.setdefault(stem, {})[output] = out / name
    parts: dict[str, list] = {}
    seen = 0  # rows in the shards before this one
    for stem in sorted(shards):
        rows = 0
        for output, path in shards[stem].items():
            if output == "*":  # a Parquet shard: every output's column, its rows sampled
                table = pyarrow.parquet.read_table(path)
                rows = table.num_rows
                taken = table.take(np.arange((-seen) % step, rows, step))
                for column in taken.column_names:
                    if column != "id":
                        parts.setdefault(column, []).append(
                            np.array(taken.column(column).to_pylist()))
                continue
            a = np.load(path, mmap_mode="r")
            parts.setdefault(output, []).append(np.array(a[(-seen) % step::step]))
            rows = len(a)
        seen += rows
    return {k: np.concatenate(v) for k, v in parts.items()}


def sync(runner: Runner) -> None:
    if runner.cuda:
        torch.cuda.synchronize(runner.device)


def timed_loop(fn, runner: Runner, seconds: float, repeats: int = 3) -> float:
    """Median seconds per iteration over `repeats` loops of about `seconds` each."""
    for _ in range(5):  # warm
        fn()
    sync(runner)
    t0 = time.perf_counter()
    for _ in range(10):
        fn()
    sync(runner)
    per = (time.perf_counter() - t0) / 10
    iters = int(min(20000, max(20, seconds / max(per, 1e-7))))
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(runner)
        out.append((time.perf_counter() - t0) / iters)
    return statistics.median(out)


def replay_rates(case: Case, spec: PipelineSpec, seconds: float) -> ReplayRates:
    """The batch bucket's graph back to back, on staging filled once from the file's first
    batch (real records, not zeros)."""
    first = next(iter(read_batches(spec)))
    n = len(first)
    with Runner(spec) as runner:
        with torch.inference_mode():
            runner.launcher.host_slots(2)
            bucket = runner.launcher.stage(first.fields, n, first.lengths, 0)
            runner.launcher.stage(first.fields, n, first.lengths, 1)
            # one launch first: a bucket under capture.lazy is set up on its first use
            runner.launcher.launch(bucket, 0, n, first.lengths).result()
            lane = runner.lanes[0]
            # the graph (or eager step) alone, inputs already in the static device views
            for dst, src in runner.launcher.slots[0].copies(bucket, lane).h2d:
                dst.copy_(src)
            graph_s = timed_loop(lane.graphs[bucket].run, runner, seconds)
            slot = [0]

            def device_path():  # h2d + replay + d2h enqueued back to back
                runner.launcher.launch(bucket, slot[0], n, first.lengths)
                slot[0] ^= 1

            path_s = timed_loop(device_path, runner, seconds)

            def launch_collect():
                runner.launcher.launch(bucket, 0, n, first.lengths).result()

            lc_s = timed_loop(launch_collect, runner, seconds)
        note = f"bucket {bucket.name}, {runner.states[bucket].status}"
    return ReplayRates(graph=n / graph_s, device_path=n / path_s, launch_collect=n / lc_s,
                       step_us=graph_s * 1e6, note=note)


def compare_outputs(results: list[tuple[str, RunResult]]) -> str:
    """Every run's outputs against the reference run's (the first with the most records): the
    same shards (sha256) where the runs have the same records, else the same sampled rows;
    where not, the largest difference."""
    ref_label, ref = max(results, key=lambda lr: lr[1].records)  # the first with the most
    same, differ = [], []
    for label, r in results:
        if r is ref:
            continue
        if r.records == ref.records and r.hashes == ref.hashes:
            same.append(label)
            continue
        worst, rows, total = 0.0, 0, 0
        for name, a in r.sample.items():
            b = ref.sample[name]
            k = min(len(a), len(b))  # a JSONL file may hold fewer records
            d = np.abs(a[:k].astype(np.float64) - b[:k].astype(np.float64)).reshape(k, -1)
            worst = max(worst, float(d.max()) if d.size else 0.0)
            rows, total = rows + int((d.max(axis=1) > 0).sum()), total + k
        if worst == 0:
            same.append(label + " (sampled rows)")
        else:
            differ.append(f"{label}: max |diff| {worst:.3g} in {rows} of {total} sampled rows")
    text = f"outputs the same as {ref_label}'s: {', '.join(same) or 'none'}"
    return text + (f"; DIFFERENT: {'; '.join(differ)}" if differ else "")


def bench_model(case: Case, formats: list[str], workdir: Path, device: str, report: Report,
                replay_seconds: float, repeat: int = 1) -> None:
    t0 = time.perf_counter()
    files = list(dict.fromkeys(IN_FORMAT.get(f, f) for f in formats))
    paths = write_inputs(case, case.records, workdir, files, case.jsonl_records)
    report.timings.append((f"{case.name}: write {case.records:,} records x "
                           f"{len(formats)} formats", time.perf_counter() - t0))
    out = workdir / "out"
    step = max(1, case.records // 512)  # rows sampled to compare outputs across runs
    ran: list[tuple[str, RunResult]] = []
    for k, fmt in enumerate(formats):
        source = IN_FORMAT.get(fmt, fmt)
        path = paths[source]
        records = case.records_in(source)
        out_format = OUT_FORMAT.get(fmt, "npy")
        label = path.suffix.lstrip(".") + ("" if out_format == "npy" else f" > {out_format}")
        row = Row(case.name, label, records, path.stat().st_size / 2**20)
        report.rows.append(row)
        spec = case.spec(path, out, device, out_format)
        t0 = time.perf_counter()
        try:
            n, row.read_rate = read_rate(spec)
            assert n == records, f"read {n} of {records} records"
            row.serial = run_pipeline(spec, out, overlap=False, step=step)
            runs = [run_pipeline(spec, out, overlap=True, step=step) for _ in range(repeat)]
            row.overlapped = sorted(runs, key=lambda r: r.rate)[(len(runs) - 1) // 2]
            if repeat > 1:  # the median run is the table's; every run's rate goes in the notes
                report.notes.append(f"{case.name} {row.fmt}: {repeat} overlapped runs, rec/s "
                                    + ", ".join(fmt_rate(r.rate) for r in runs))
            ran += [(f"{row.fmt} serial", row.serial), (f"{row.fmt} overlapped", row.overlapped)]
        except Exception as e:  # noqa: BLE001 - reported in the table, the rest still runs
            row.error = f"{type(e).__name__}: {e}"
        report.timings.append((f"{case.name} {row.fmt}: read pass + serial + overlapped runs",
                               time.perf_counter() - t0))
        if all(IN_FORMAT.get(f, f) != source for f in formats[k + 1:]):
            path.unlink()
    if len(ran) > 1:
        report.notes.append(f"{case.name}: {compare_outputs(ran)}")
    if formats:
        t0 = time.perf_counter()
        first = IN_FORMAT.get(formats[0], formats[0])
        small = write_inputs(case, case.batch, workdir, [first])[first]
        try:
            spec = case.spec(small, out, device)
            rates = report.replay[case.name] = replay_rates(case, spec, replay_seconds)
            rates.write = write_rate(case, spec, out, case.records)
        finally:
            small.unlink()
        report.timings.append((f"{case.name}: replay loops, write-only pass",
                               time.perf_counter() - t0))


# -- the report -----------------------------------------------------------------------------

def fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def fmt_ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def render(report: Report, args, cases: dict[str, Case], device: str) -> str:
    lines = ["# bench_datapath.py: the data path against back-to-back replay", ""]
    lines += environment(device, args)
    lines += ["", "## Whole runs", "",
              "Records/s: manifest.totals.records_per_s (records out / streaming wall time, "
              "setup and capture excluded). read-only: read_batches alone; write-only: the "
              "ShardWriter alone; replay-only: the batch bucket's graph back to back. "
              "Host phases (overlapped run, seconds per thread): stager read / stage, "
              "launching thread read_wait / launch, completer device_wait / write. "
              "Overlapped, the three threads run side by side: the busiest bounds the rate.",
              "",
              "| model | format | records | file MiB | read-only rec/s | write-only rec/s | "
              "serial rec/s | overlapped rec/s | overlapped / serial | replay-only rec/s | "
              "overlapped / replay | device idle | host phases s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.rows:
        rp = report.replay.get(r.model)
        if r.error:
            lines.append(f"| {r.model} | {r.fmt} | {r.records:,} | {r.mib:,.0f} | "
                         f"{fmt_rate(r.read_rate)} | error: {r.error} ||||||||")
            continue
        o, s = r.overlapped, r.serial
        host = " / ".join(f"{o.host.get(k, 0):.2f}" for k in
                          PHASES)
        idle = "-" if o.idle is None else f"{o.idle:.1%}"
        lines.append(
            f"| {r.model} | {r.fmt} | {r.records:,} | {r.mib:,.0f} | {fmt_rate(r.read_rate)} | "
            f"{fmt_rate(rp.write if rp else None)} | {fmt_rate(s.rate)} | {fmt_rate(o.rate)} | "
            f"{fmt_ratio(o.rate, s.rate)} | "
            f"{fmt_rate(rp.graph if rp else None)} | "
            f"{fmt_ratio(o.rate, rp.graph if rp else None)} | {idle} | {host} |")
    lines += ["", "## Back-to-back rates of the same graphs (Runner from the same spec)", "",
              "| model | batch | step us | replay-only rec/s | device path rec/s "
              "(launch back to back) | launch+collect rec/s | write-only rec/s | bucket |",
              "|---|---|---|---|---|---|---|---|"]
    for name, rp in report.replay.items():
        lines.append(f"| {name} | {cases[name].batch} | {rp.step_us:,.0f} | "
                     f"{fmt_rate(rp.graph)} | {fmt_rate(rp.device_path)} | "
                     f"{fmt_rate(rp.launch_collect)} | {fmt_rate(rp.write)} | {rp.note} |")
    lines += ["", "## Runs in detail", "",
              "| model | format | path | rec/s | setup s | run wall s (setup, streaming, "
              "close) | device idle | host phases s | warnings |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in report.rows:
        for label, res in (("serial", r.serial), ("overlapped", r.overlapped)):
            if res is None:
                continue
            host = " / ".join(f"{res.host.get(k, 0):.2f}" for k in
                              PHASES)
            idle = "-" if res.idle is None else f"{res.idle:.1%}"
            warn = "; ".join(res.warnings)[:160]
            lines.append(f"| {r.model} | {r.fmt} | {label} | {fmt_rate(res.rate)} | "
                         f"{res.setup_s:.1f} | {res.wall_s:.1f} | {idle} | {host} | {warn} |")
    lines += ["", "## Notes", ""]
    for name, case in cases.items():
        if name in report.replay:
            lines.append(f"- {name}: args {case.args}, dtype {case.dtype}, batch {case.batch}, "
                         f"buckets {case.buckets}, {case.records:,} records, output shards of "
                         f"{case.rows_per_file:,} rows (npy).")
    if "decoder" in cases and "decoder" in report.replay and not cases["decoder"].greedy:
        dec = cases["decoder"]
        vocab, kind = dec.args["vocab"], dec.out_dtype or "float32"
        width = 2 if kind in ("float16",) else 4  # bfloat16 is written as float32
        lines.append(f"- decoder: every record writes its logits, {vocab} {kind} "
                     f"({vocab * width / 1024:.0f} KB): {dec.records:,} records are "
                     f"{dec.records * vocab * width / 1e9:.1f} GB of outputs (1M would "
                     f"be {1e6 * vocab * width / 1e9:.0f} GB), hence --records-decoder.")
    lines += [f"- {n}" for n in report.notes]
    lines += ["", "Time per part (s): " + "; ".join(f"{label} {s:.1f}"
                                                   for label, s in report.timings)]
    return "\n".join(lines) + "\n"


def environment(device: str, args) -> list[str]:
    gpu = torch.cuda.get_device_name(0) if device != "cpu" else "none (CPU)"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    import pyarrow
    return [f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"- device: {device}, GPU: {gpu}, torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}, pyarrow {pyarrow.__version__}, numpy {np.__version__}",
            f"- host: {platform.platform()}, python {platform.python_version()}, "
            f"{os.cpu_count()} CPUs, {usable_cores()} usable (affinity); Parquet "
            f"{Tuning.from_machine().parquet_threads} decoding threads",
            f"- commit: {commit or 'unknown'} (working tree may differ)",
            f"- command: python3 benchmarks/bench_datapath.py {' '.join(sys.argv[1:])}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="decoder,mlp")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--records", type=int, default=None,
                   help="MLP records per file (default 1,000,000; --smoke 20,000)")
    p.add_argument("--jsonl-records", type=int, default=200_000,
                   help="MLP records in its JSONL file (default 200,000; 0: as --records)")
    p.add_argument("--records-decoder", type=int, default=None,
                   help="decoder records per file (default 20,000; --smoke 2,000)")
    p.add_argument("--rows-per-file-decoder", type=int, default=5000)
    p.add_argument("--decoder-vocab", type=int, default=32000,
                   help="the decoder's vocabulary, so its logits' width (default 32,000; "
                   "pipelines/decoder-step.yaml has 1,000)")
    p.add_argument("--decoder-head", default="logits", choices=["logits", "greedy"],
                   help="the decoder's output: its logits (default), or greedy: the next token, "
                   "argmax inside the graph (a record writes 8 bytes)")
    p.add_argument("--decoder-batch", type=int, default=32,
                   help="the decoder's data.batch_size, also its largest batch bucket "
                   "(buckets 1, 8, 32 and it; default 32)")
    p.add_argument("--logits-dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="the decoder's outputs.logits.dtype (default: the model's, written as "
                   "float32); float16 halves the bytes written")
    p.add_argument("--replay-seconds", type=float, default=None,
                   help="length of each replay loop (default 1.0; --smoke 0.2)")
    p.add_argument("--repeat", type=int, default=1,
                   help="overlapped runs per format; the table shows the median one (default 1)")
    p.add_argument("--workdir", default=None, help="input and output files (default: a temp "
                   "dir, removed at the end)")
    p.add_argument("--out", default=None, help="write the markdown report here too")
    p.add_argument("--parquet-row-group", type=int, default=65536,
                   help="records per Parquet row group (default 65,536; 0: pyarrow's default, "
                   "as pq.write_table and pandas write: up to 1Mi records in one)")
    p.add_argument("--smoke", action="store_true", help="tiny models and files; runs on a CPU")
    args = p.parse_args()
    global PARQUET_ROW_GROUP
    PARQUET_ROW_GROUP = args.parquet_row_group or None
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    args.records = args.records or (20_000 if args.smoke else 1_000_000)
    args.records_decoder = args.records_decoder or (2_000 if args.smoke else 20_000)
    args.replay_seconds = args.replay_seconds or (0.2 if args.smoke else 1.0)
    formats = [f for f in args.formats.split(",") if f]
    bad = set(formats) - set(FORMATS)
    if bad:
        p.error(f"unknown formats {sorted(bad)}; choose from {', '.join(FORMATS)}")
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    cases = make_cases(args, cuda)
    cases = {m: cases[m] for m in args.models.split(",") if m}
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_datapath-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report = Report()
    t_all = time.perf_counter()
    try:
        for case in cases.values():
            need = estimate_bytes(case, formats)
            free = shutil.disk_usage(workdir).free
            if need > 0.9 * free:
                sys.exit(f"{case.name}: needs about {need / 2**30:.1f} GiB in {workdir}, "
                         f"{free / 2**30:.1f} GiB free: lower --records / --records-decoder")
            print(f"== {case.name}: {case.records:,} records, formats {formats} "
                  f"(about {need / 2**30:.1f} GiB on disk at once)", flush=True)
            bench_model(case, formats, workdir, device, report, args.replay_seconds,
                        args.repeat)
            for r in report.rows[-len(formats):]:
                print(f"   {r.fmt}: " + (r.error or f"read {fmt_rate(r.read_rate)}, serial "
                      f"{fmt_rate(r.serial.rate)}, overlapped {fmt_rate(r.overlapped.rate)} rec/s"),
                      flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report.timings.append(("total", time.perf_counter() - t_all))
    text = render(report, args, cases, device)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


def estimate_bytes(case: Case, formats: list[str]) -> int:
    """Input files (all formats at once) plus one run's outputs."""
    n = case.records
    if case.decoder:
        per_in = {"jsonl": 36, "npy": 16, "parquet": 20, "parquet-out": 0}
        per_out = 16 if case.greedy else case.args["vocab"] * 4 + 8
    else:
        w = case.args["in_features"]
        per_in = {"jsonl": 7 * w + 8, "npy": 4 * w, "parquet": 4 * w + 8, "parquet-out": 0}
        per_out = case.args["out_features"] * 4 + 8
    return sum(per_in[f] * case.records_in(f) for f in formats) + per_out * n


if __name__ == "__main__":
    main()
