"""Reader speed: records/s of read_batches over a decoder-like JSONL, and over the same dense
floats as .npy and as Parquet (a list<float> column in row groups of 65536 records, as
bench_datapath.py writes it).

    PYTHONPATH=. python3 benchmarks/bench_reader.py [--records 200000] [--width 64]
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

from graphrun.spec import PipelineSpec
from graphrun.stream import read_batches


def decoder_spec(path: Path, out: Path) -> PipelineSpec:
    # tokens [batch, 1] and positions [batch], as one LLM decode step takes them
    return PipelineSpec.model_validate({
        "version": 1, "name": "bench-decoder", "model": {"builtin": "decoder"},
        "inputs": {"tokens": {"shape": ["batch", 1], "dtype": "int64", "range": [0, 32000]},
                   "positions": {"shape": ["batch"], "dtype": "int64", "range": [0, 512]}},
        "outputs": {"logits": {"shape": ["batch", 1, 32000]}},
        "buckets": {"batch": [1, 8, 32]},
        "data": {"path": str(path), "id_field": "id", "batch_size": 32},
        "output": {"dir": str(out)},
    })


def mlp_spec(path: Path, out: Path, width: int) -> PipelineSpec:
    return PipelineSpec.model_validate({
        "version": 1, "name": "bench-mlp", "model": {"builtin": "mlp"},
        "inputs": {"x": {"shape": ["batch", width], "dtype": "float32", "finite": True}},
        "outputs": {"y": {"shape": ["batch", width]}},
        "buckets": {"batch": [1, 8, 32]},
        "data": {"path": str(path), "batch_size": 32},
        "output": {"dir": str(out)},
    })


def write_decoder_jsonl(path: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32000, n).tolist()
    positions = rng.integers(0, 512, n).tolist()
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": i, "tokens": [tokens[i]], "positions": positions[i]}) + "\n")


def write_parquet(path: Path, x: np.ndarray) -> None:
    offsets = pa.array(np.arange(0, x.size + 1, x.shape[1], dtype=np.int32))
    table = pa.table({"x": pa.ListArray.from_arrays(offsets, pa.array(x.reshape(-1)))})
    pq.write_table(table, path, row_group_size=65536)


def records_per_second(spec: PipelineSpec, repeats: int = 3) -> tuple[int, float]:
    """Best of `repeats` full passes (the page cache is warm after the first)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = sum(len(b) for b in read_batches(spec))
        best = min(best, time.perf_counter() - t0)
    return n, n / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        jsonl, npy, parquet = tmp / "decode.jsonl", tmp / "x.npy", tmp / "x.parquet"
        write_decoder_jsonl(jsonl, args.records)
        x = np.random.default_rng(0).standard_normal((args.records, args.width), dtype=np.float32)
        np.save(npy, x)
        write_parquet(parquet, x)
        del x
        for label, spec in [
            (f"jsonl decoder (tokens [1], positions), {jsonl.stat().st_size >> 20} MiB",
             decoder_spec(jsonl, tmp / "out")),
            (f"npy float32 [{args.records}, {args.width}]", mlp_spec(npy, tmp / "out", args.width)),
            (f"parquet list<float32> [{args.records}, {args.width}]",
             mlp_spec(parquet, tmp / "out", args.width)),
        ]:
            n, rate = records_per_second(spec)
            print(f"{label}: {n} records, {rate:,.0f} records/s")


if __name__ == "__main__":
    main()
