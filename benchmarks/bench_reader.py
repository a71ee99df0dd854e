"""Reader speed: records/s of read_batches over a decoder-like JSONL, and over the same dense
floats as .npy and as Parquet (a list<float> column in row groups of 65536 records of values
with 3 decimals, as bench_datapath.py writes it: dictionary-encoded, ~1.7 bytes a value); and
the decoder's records (tokens [1], positions) as an .npz and as Parquet (a list<int64> column
and an int64 one), the same values in both: formats npz-decoder and parquet-decoder.

    PYTHONPATH=. python3 benchmarks/bench_reader.py [--records 200000] [--width 64]
        [--batch-size 32] [--formats jsonl,npy,parquet] [--parquet-row-group 65536]
    PYTHONPATH=. python3 benchmarks/bench_reader.py --records 262144 --batch-size 128 \
        --formats npz-decoder,parquet-decoder

Each line also gives the time per batch of that pass, the CPU time per batch of the caller's
thread (time.thread_time): the part the stager of an overlapped run spends itself, mostly
holding the GIL, which it shares with the launching and completing threads; and the process's
CPU time per batch (every thread). Parquet row groups are decoded and checked on
tuning.parquet_threads pool threads (GRAPHRUN_PARQUET_THREADS), whose time is not the caller's:
on a machine of few cores the wall time is theirs. With
--parquet-row-group 0 the file is one row group, streamed on the caller's thread.
The MLP case of the GPU machine (1M records of 256 float32, batches of 1024):

    PYTHONPATH=. python3 benchmarks/bench_reader.py --records 1000000 --width 256 \
        --batch-size 1024 --formats npy,parquet
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from graphrun.spec.keys import PipelineSpec
from graphrun.read.stream import read_batches
from graphrun.base.tuning import Tuning


def decoder_spec(path: Path, out: Path, batch_size: int = 32) -> PipelineSpec:
    # tokens [batch, 1] and positions [batch], as one LLM decode step takes them
    return PipelineSpec.model_validate({
        "version": 1, "name": "bench-decoder", "model": {"builtin": "decoder"},
        "inputs": {"tokens": {"shape": ["batch", 1], "dtype": "int64", "range": [0, 32000]},
                   "positions": {"shape": ["batch"], "dtype": "int64", "range": [0, 512]}},
        "outputs": {"logits": {"shape": ["batch", 1, 32000]}},
        "buckets": {"batch": sorted({1, 8, 32, batch_size})},
        "data": {"path": str(path), "batch_size": batch_size,
                 **({"id_field": "id"} if path.suffix == ".jsonl" else {})},
        "output": {"dir": str(out)},
    })


def mlp_spec(path: Path, out: Path, width: int, batch_size: int = 32) -> PipelineSpec:
    return PipelineSpec.model_validate({
        "version": 1, "name": "bench-mlp", "model": {"builtin": "mlp"},
        "inputs": {"x": {"shape": ["batch", width], "dtype": "float32", "finite": True}},
        "outputs": {"y": {"shape": ["batch", width]}},
        "buckets": {"batch": sorted({1, 8, 32, batch_size})},
        "data": {"path": str(path), "batch_size": batch_size},
        "output": {"dir": str(out)},
    })


def write_decoder_jsonl(path: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32000, n).tolist()
    positions = rng.integers(0, 512, n).tolist()
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": i, "tokens": [tokens[i]], "positions": positions[i]}) + "\n")


def write_decoder_arrays(npz: Path | None, parquet: Path | None, n: int,
                         group_rows: int) -> None:
    """The decoder's records without ids: an uncompressed .npz and a Parquet file of the same
    values (tokens a list<int64> column of one value per record, as pandas writes [n, 1])."""
    rng = np.random.default_rng(0)
    tokens, positions = rng.integers(0, 32000, (n, 1)), rng.integers(0, 512, n)
    if npz is not None:
        np.savez(npz, tokens=tokens, positions=positions)
    if parquet is not None:
        offsets = pa.array(np.arange(n + 1, dtype=np.int32))
        pq.write_table(pa.table({"tokens": pa.ListArray.from_arrays(offsets,
                                                                    pa.array(tokens[:, 0])),
                                 "positions": pa.array(positions)}),
                       parquet, row_group_size=group_rows)


def mlp_values(n: int, width: int) -> np.ndarray:
    """[n, width] float32 of 3 decimals in [-9.999, 9.999], as bench_datapath.py's MLP inputs."""
    codes = np.random.default_rng(0).standard_normal((n, width), dtype=np.float32) * 1000
    return (np.clip(np.rint(codes), -9999, 9999) / 1000).astype(np.float32)


def write_parquet(path: Path, x: np.ndarray, group_rows: int = 65536) -> None:
    """A list<float> column, as bench_datapath.py writes it: one row group per write."""
    with pq.ParquetWriter(path, pa.schema([("x", pa.list_(pa.float32()))])) as w:
        for lo in range(0, len(x), group_rows):
            part = x[lo:lo + group_rows]
            offsets = pa.array(np.arange(0, part.size + 1, x.shape[1], dtype=np.int32))
            w.write_table(pa.table({"x": pa.ListArray.from_arrays(
                offsets, pa.array(part.reshape(-1)))}), row_group_size=group_rows)


def records_per_second(spec: PipelineSpec, repeats: int = 5
                       ) -> tuple[int, float, float, float, float]:
    """(records, records/s, seconds per batch, caller's and process's CPU seconds per batch):
    of the fastest of `repeats` full passes (the page cache is warm after the first)."""
    best = (float("inf"), 0.0, 0.0)
    for _ in range(repeats):
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        n = batches = 0
        for b in read_batches(spec):
            n += len(b)
            batches += 1
        best = min(best, (time.perf_counter() - t0, time.thread_time() - c0,
                          time.process_time() - p0))
    wall, cpu, process = best
    per = max(batches, 1)
    return n, n / wall, wall / per, cpu / per, process / per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32, help="of every case but jsonl (32)")
    parser.add_argument("--formats", default="jsonl,npy,parquet")
    parser.add_argument("--parquet-row-group", type=int, default=65536,
                        help="records per Parquet row group (0: one row group)")
    args = parser.parse_args()
    wanted = args.formats.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        jsonl, npy, parquet = tmp / "decode.jsonl", tmp / "x.npy", tmp / "x.parquet"
        cases = []
        if "jsonl" in wanted:
            write_decoder_jsonl(jsonl, args.records)
            cases.append((f"jsonl decoder (tokens [1], positions), "
                          f"{jsonl.stat().st_size >> 20} MiB, batches of 32",
                          decoder_spec(jsonl, tmp / "out")))
        npz_dec = tmp / "decode.npz" if "npz-decoder" in wanted else None
        pq_dec = tmp / "decode.parquet" if "parquet-decoder" in wanted else None
        if npz_dec or pq_dec:
            group = args.parquet_row_group or args.records
            write_decoder_arrays(npz_dec, pq_dec, args.records, group)
            if npz_dec:
                cases.append((f"npz decoder (tokens [1], positions), batches of "
                              f"{args.batch_size}",
                              decoder_spec(npz_dec, tmp / "out", args.batch_size)))
            if pq_dec:
                cases.append((f"parquet decoder (tokens list<int64>, positions int64), batches "
                              f"of {args.batch_size}, row groups of {group}, "
                              f"{Tuning.from_machine().parquet_threads} threads",
                              decoder_spec(pq_dec, tmp / "out", args.batch_size)))
        if "npy" in wanted or "parquet" in wanted:
            x = mlp_values(args.records, args.width)
            if "npy" in wanted:
                np.save(npy, x)
                cases.append((f"npy float32 [{args.records}, {args.width}], batches of "
                              f"{args.batch_size}",
                              mlp_spec(npy, tmp / "out", args.width, args.batch_size)))
            if "parquet" in wanted:
                write_parquet(parquet, x, args.parquet_row_group or len(x))
                cases.append((f"parquet list<float32> [{args.records}, {args.width}], "
                              f"batches of {args.batch_size}, row groups of "
                              f"{args.parquet_row_group or len(x)}, "
                              f"{Tuning.from_machine().parquet_threads} threads",
                              mlp_spec(parquet, tmp / "out", args.width, args.batch_size)))
            del x
        for label, spec in cases:
            n, rate, per_batch, cpu, process = records_per_second(spec)
            print(f"{label}: {n} records, {rate:,.0f} records/s, {per_batch * 1e6:,.1f} us "
                  f"per batch, caller's thread {cpu * 1e6:,.1f} us CPU per batch, process "
                  f"{process * 1e6:,.1f} us CPU per batch")


if __name__ == "__main__":
    main()
