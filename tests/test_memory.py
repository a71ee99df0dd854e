"""Memory is bounded: peak RSS of a whole run does not grow with the input file's size.

Each run is a fresh process (ru_maxrss is a high-water mark for the whole process), running
graphrun.run over a small and a big file of the same records; the big run's peak must stay
within 1.25x + 30 MiB of the small one's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from graphrun.spec.keys import PipelineSpec
from graphrun.read.stream import read_batches

# end to end: processes, real models, whole runs (`pytest -m "not slow"` leaves them out)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20

SPEC = """\
version: 1
name: rss
device: cpu
model:
  builtin: mlp
  args: {in_features: 4, hidden: 8, layers: 2, out_features: 2}
inputs:
  x: {shape: [batch, 4], dtype: float32}
outputs:
  y: {shape: [batch, 2]}
buckets:
  batch: [1, 64, 1024]
capture:
  warmup_iters: 1
data:
  path: %(data)s
  batch_size: 1024
output:
  dir: out
  rows_per_file: 100000
"""

# graphrun.run in a fresh process; prints records out and the peak RSS in bytes.
RUN = textwrap.dedent("""\
    import json, resource, sys
    import graphrun
    from graphrun.base.tuning import Tuning
    tuning = Tuning.from_machine(**TUNING)
    manifest = graphrun.run(graphrun.load_spec(sys.argv[1]), out=sys.argv[2],
                            overwrite=True, overlap=sys.argv[3] == "1", tuning=tuning)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    print(json.dumps({"records": manifest.totals.records_out,
                      "peak": peak if sys.platform == "darwin" else peak * 1024}))
""")


def values(n: int) -> np.ndarray:
    return np.random.default_rng(n).standard_normal((n, 4), dtype=np.float32)


def write_npy(path: Path, n: int) -> None:
    np.save(path, values(n))


def write_jsonl(path: Path, n: int) -> None:
    x = values(n).round(4)
    with open(path, "w") as f:
        for lo in range(0, n, 50_000):
            rows = x[lo:lo + 50_000].tolist()
            f.write("".join(f'{{"x": {json.dumps(r)}}}\n' for r in rows))


def write_parquet(path: Path, n: int) -> None:
    """One row group, as pq.write_table writes up to 1Mi records."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    x = values(n)
    pq.write_table(pa.table({"x": pa.ListArray.from_arrays(
        pa.array(np.arange(0, 4 * n + 1, 4, dtype=np.int32)), pa.array(x.reshape(-1)))}), path,
        row_group_size=None)


def start_run(tmp_path: Path, data: Path, overlap: bool, tuning: dict | None = None):
    """graphrun.run over `data` in a fresh process, started; returns a function that waits
    for it and gives its peak RSS in bytes."""
    spec = tmp_path / f"{data.stem}.yaml"
    spec.write_text(SPEC % {"data": data.name})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen([sys.executable, "-c", f"TUNING = {tuning or {}!r}\n" + RUN,
                             str(spec), str(tmp_path / data.stem), "1" if overlap else "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def peak() -> int:
        try:
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            proc.kill()
        assert proc.returncode == 0, stderr[-3000:]
        got = json.loads(stdout.strip().splitlines()[-1])
        assert got["records"] == int(data.stem.split("-")[1])
        return got["peak"]

    peak.proc = proc
    return peak


def peak_rss(tmp_path: Path, small: Path, big: Path, overlap: bool,
             tuning: dict | None = None) -> tuple[int, int]:
    """The peak RSS of a run over the small file and of one over the big file. Each is its
    own process (ru_maxrss is one process's high-water mark, whatever else runs beside it),
    so the two run at the same time."""
    waits = [start_run(tmp_path, data, overlap, tuning) for data in (small, big)]
    try:
        return waits[0](), waits[1]()
    finally:
        for wait in waits:  # the other one too, should one fail
            wait.proc.kill()


def assert_flat(small: int, big: int, what: str) -> None:
    limit = 1.25 * small + 30 * MiB
    assert big <= limit, (f"{what}: peak RSS {big / MiB:.0f} MiB over the big file vs "
                          f"{small / MiB:.0f} MiB over the small one (limit {limit / MiB:.0f} "
                          "MiB): memory grows with the input's size")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
def test_peak_rss_flat_in_npy_size(tmp_path, overlap):
    small, big = tmp_path / "x-10000.npy", tmp_path / "x-1000000.npy"
    write_npy(small, 10_000)
    write_npy(big, 1_000_000)
    assert_flat(*peak_rss(tmp_path, small, big, overlap),
                f"npy, {'overlapped' if overlap else 'serial'}")


def test_peak_rss_flat_in_jsonl_size(tmp_path):
    small, big = tmp_path / "x-20000.jsonl", tmp_path / "x-400000.jsonl"
    write_jsonl(small, 20_000)
    write_jsonl(big, 400_000)
    assert_flat(*peak_rss(tmp_path, small, big, True), "jsonl")


def test_peak_rss_flat_in_parquet_size(tmp_path):
    """A row group of 1M records over PARQUET_GROUP_BYTES, streamed a batch at a time: no more
    memory than a file of 10,000."""
    small, big = tmp_path / "x-10000.parquet", tmp_path / "x-1000000.parquet"
    write_parquet(small, 10_000)
    write_parquet(big, 1_000_000)
    tuning = {"parquet_group_bytes": 4 << 20}
    assert_flat(*peak_rss(tmp_path, small, big, True, tuning), "parquet")


def _rss_file() -> int:
    """Resident file-backed pages of this process (memory-mapped files among them), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    raise LookupError("no RssFile in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_memory_mapped_input_pages_are_released(tmp_path):
    """A mapped page that was read stays resident until unmapped: without releasing each chunk
    after reading it, one pass over a 64 MB .npy adds 64 MB to RSS."""
    path = tmp_path / "x.npy"
    np.save(path, np.ones((250_000, 64), np.float32))  # 64 MB
    spec = PipelineSpec.model_validate({
        "version": 1, "name": "mapped", "device": "cpu", "model": {"builtin": "mlp"},
        "inputs": {"x": {"shape": ["batch", 64]}}, "outputs": {"y": {"shape": ["batch", 16]}},
        "buckets": {"batch": [1024]}, "data": {"path": str(path), "batch_size": 1024},
        "output": {"dir": str(tmp_path / "out")}})
    before, most, records = _rss_file(), 0, 0
    for batch in read_batches(spec):
        records += len(batch)
        most = max(most, _rss_file() - before)
    assert records == 250_000
    assert most < 24 * MiB, f"{most / MiB:.0f} MiB of the 64 MB file stayed mapped"
