"""data.group_by_length: batches formed in length order within windows, outputs in input order,
resume exact, the padding saved reported (grouping.py, stream.py, completer.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

import graphrun
from graphrun.base.errors import InputError, Interrupted
from graphrun.read.grouping import PaddingCount, Reorder, sorted_batches
from graphrun.read.records import RecordBatch

ROOT = Path(__file__).resolve().parent.parent
ENCODER = ROOT / "examples/models/tiny_encoder.py"

SPEC = """\
version: 1
name: grouped
device: cpu
model:
  target: {model}:build
  args: {{vocab: 50, d_model: 8, heads: 2, layers: 1, max_len: 64}}
inputs:
  tokens: {{shape: [batch, seq], dtype: int64, range: [0, 50]}}
  mask: {{shape: [batch, seq], dtype: int64, range: [0, 2], pad: 0}}
outputs:
  hidden: {{shape: [batch, seq, 8]}}
  pooled: {{shape: [batch, 8]}}
buckets:
  batch: [1, 4, 8]
  seq: [8, 16, 32, 64]
data:
  path: data.jsonl
  id_field: id
  batch_size: 8
  on_bad_record: skip
output:
  dir: out
  format: parquet
  rows_per_file: 10
"""

# A model that sends its own process SIGINT when it meets the marker record (20 tokens of 7)
# while a trigger file exists: the run stops after the batch in flight, inside a window.
STOPPING = """\
import os, signal, importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location("tiny_encoder", {encoder!r})
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)
TRIGGER = Path(__file__).with_name("stop")


class Stopping(torch.nn.Module):
    def __init__(self, **args):
        super().__init__()
        self.inner = tiny.build(**args)

    def forward(self, tokens, mask):
        marked = tokens.shape[1] >= 20 and bool((tokens[:, :20] == 7).all(dim=1).any())
        if marked and TRIGGER.exists():
            TRIGGER.unlink()
            os.kill(os.getpid(), signal.SIGINT)
        return self.inner(tokens, mask)


def build(**args):
    return Stopping(**args)
"""


def write_job(tmp_path: Path, n: int = 300, bad: tuple = (), seed: int = 0,
              marker: int | None = None) -> Path:
    """n records of random lengths 1..60 (ids "r<i>"); the lines in `bad` hold a token out
    of range (rejected); the marker line 20 tokens of 7 (mid-length: a batch inside its window)."""
    rng = random.Random(seed)
    with open(tmp_path / "data.jsonl", "w") as f:
        for i in range(n):
            length = rng.randint(1, 60)
            tokens = [rng.randrange(50) for _ in range(length)]
            if i in bad:
                tokens[0] = 99
            if i == marker:
                tokens, length = [7] * 20, 20
            f.write(json.dumps({"id": f"r{i}", "tokens": tokens, "mask": [1] * length}) + "\n")
    path = tmp_path / "grouped.yaml"
    path.write_text(SPEC.format(model=ENCODER))
    return path


def load(path: Path, *sets: str):
    return graphrun.load_spec(path, list(sets))


def outputs(out: Path) -> tuple[list, np.ndarray, list]:
    import pyarrow.parquet as pq

    rows = [pq.read_table(f).to_pylist() for f in sorted(out.glob("part-*.parquet"))]
    rows = [r for shard in rows for r in shard]
    return ([r["id"] for r in rows], np.array([r["pooled"] for r in rows]),
            [np.array(r["hidden"]) for r in rows])


def assert_same_outputs(a: Path, b: Path) -> None:
    ids_a, pooled_a, hidden_a = outputs(a)
    ids_b, pooled_b, hidden_b = outputs(b)
    assert ids_a == ids_b  # the ids, in input order, exactly
    np.testing.assert_allclose(pooled_a, pooled_b, rtol=1e-4, atol=1e-5)
    assert [h.shape for h in hidden_a] == [h.shape for h in hidden_b]
    for x, y in zip(hidden_a, hidden_b):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


def padded(manifest) -> int:
    return sum(b.padded_positions.get("seq", 0) for b in manifest.buckets)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_grouped_outputs_equal_ungrouped_in_input_order_and_pad_less(tmp_path, overlap):
    path = write_job(tmp_path)
    plain = graphrun.run(load(path), out=tmp_path / "plain", overlap=overlap)
    grouped = graphrun.run(load(path, "data.group_by_length=64"), out=tmp_path / "grouped",
                           overlap=overlap)
    assert_same_outputs(tmp_path / "plain", tmp_path / "grouped")
    g = grouped.grouping
    # both counts agree with what the engine padded, grouped and in input order
    assert g.padded_positions == {"seq": padded(grouped)}
    assert g.padded_positions_input_order == {"seq": padded(plain)}
    assert padded(grouped) < 0.6 * padded(plain)
    assert g.padding_saved["seq"] == pytest.approx(1 - padded(grouped) / padded(plain))
    assert (g.window, g.windows) == (64, 5)  # 300 records: 4 windows of 64 and one of 44
    assert plain.grouping is None
    on_disk = json.loads((tmp_path / "grouped" / "manifest.json").read_text())
    assert on_disk["grouping"]["padded_positions"] == {"seq": padded(grouped)}


def test_oversize_batches_are_split_within_windows(tmp_path):
    path = write_job(tmp_path, n=100)
    graphrun.run(load(path, "buckets.batch=[1, 2]"), out=tmp_path / "plain")
    m = graphrun.run(load(path, "buckets.batch=[1, 2]", "data.group_by_length=40"),
                     out=tmp_path / "grouped")
    assert_same_outputs(tmp_path / "plain", tmp_path / "grouped")
    assert {b.sizes["batch"] for b in m.buckets if b.batches} == {2}  # batches of 8: 2s


def test_padding_count_by_hand(tmp_path):
    """Lengths 2, 16, 2, 16; batches of 2 in buckets batch=[2], seq=[8, 16]. Input order:
    (2, 16) twice, each 2 x 16 - 18 = 14 padded. Grouped: (2, 2) in 2 x 8 (12 padded) and
    (16, 16) in 2 x 16 (none)."""
    spec = graphrun.load_spec(write_job(tmp_path, n=4), [
        "data.batch_size=2", "data.group_by_length=4", "buckets.batch=[2]",
        "buckets.seq=[8, 16]"])
    lengths = np.array([2, 16, 2, 16])
    window = RecordBatch(np.arange(4), np.arange(4), ["x"] * 4,
                         {"tokens": [np.zeros(n, np.int64) for n in lengths],
                          "mask": [np.ones(n, np.int64) for n in lengths]}, {"seq": lengths})
    batches = sorted_batches(window, 2, lo=0)
    assert [b.indices.tolist() for b in batches] == [[0, 2], [1, 3]]
    assert [b.window_end for b in batches] == [False, True] and batches[0].window == 0
    count = PaddingCount(spec)
    count.add_window(window, batches)
    report = count.report()
    assert report["padded_positions"] == {"seq": 12}
    assert report["padded_positions_input_order"] == {"seq": 28}
    assert report["padding_saved"] == {"seq": pytest.approx(1 - 12 / 28)}


def test_reorder_puts_dense_and_ragged_outputs_back_in_input_order():
    r = Reorder()
    r.add(np.array([3, 1]), ["c", "a"], {"d": np.array([[3.0], [1.0]]),
                                         "r": [np.zeros(3), np.zeros(1)]})
    r.add(np.array([2, 0]), ["b", "z"], {"d": np.array([[2.0], [0.0]]),
                                         "r": [np.zeros(2), np.zeros(5)]})
    indices, ids, outs = r.flush()
    assert indices.tolist() == [0, 1, 2, 3] and ids == ["z", "a", "b", "c"]
    assert outs["d"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert [len(x) for x in outs["r"]] == [5, 1, 2, 3]
    assert r.parts == []  # one window held at a time


def test_rejects_inside_a_window_keep_their_lines_and_order(tmp_path):
    path = write_job(tmp_path, n=120, bad=(3, 40, 41, 77))
    plain = graphrun.run(load(path), out=tmp_path / "plain")
    grouped = graphrun.run(load(path, "data.group_by_length=32"), out=tmp_path / "grouped")
    assert_same_outputs(tmp_path / "plain", tmp_path / "grouped")
    rejects = (tmp_path / "grouped" / "rejects.jsonl").read_text()
    assert rejects == (tmp_path / "plain" / "rejects.jsonl").read_text()
    assert [(json.loads(x)["index"], json.loads(x)["where"]) for x in rejects.splitlines()] == [
        (i, f"data.jsonl:{i + 1}") for i in (3, 40, 41, 77)]
    assert (grouped.totals.records_out, grouped.totals.records_rejected) == (116, 4)


def test_a_bad_record_with_on_bad_record_error_writes_the_records_before_it(tmp_path):
    path = write_job(tmp_path, n=100, bad=(50,))
    with pytest.raises(InputError, match="range"):
        graphrun.run(load(path, "data.on_bad_record=error", "data.group_by_length=32"),
                     out=tmp_path / "grouped")
    ids, _, _ = outputs(tmp_path / "grouped")
    assert ids == [f"r{i}" for i in range(50)]


def test_a_slice_is_grouped_from_its_start(tmp_path):
    path = write_job(tmp_path, n=200)
    graphrun.run(load(path), out=tmp_path / "plain", start=13, stop=170)
    m = graphrun.run(load(path, "data.group_by_length=50"), out=tmp_path / "grouped",
                     start=13, stop=170)
    assert_same_outputs(tmp_path / "plain", tmp_path / "grouped")
    assert m.grouping.windows == 4  # 157 records: 50, 50, 50, 7


def test_resume_after_a_commit_mid_window_equals_an_uninterrupted_run(tmp_path):
    path = write_job(tmp_path, n=200, bad=(20, 95))
    spec = load(path, "data.group_by_length=48")
    graphrun.run(spec, out=tmp_path / "clean")
    graphrun.run(spec, out=tmp_path / "out")
    # as if killed right after shard 2 committed: 30 rows in, inside the first window
    journal = tmp_path / "out" / "journal.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    assert json.loads(lines[2])["read_from"] == 0
    journal.write_text("".join(lines[:3]))
    m = graphrun.run(spec, out=tmp_path / "out", resume=True)
    assert m.resumed_from == 31  # 30 rows + the reject at line 21
    assert_same_outputs(tmp_path / "clean", tmp_path / "out")
    assert ((tmp_path / "out" / "rejects.jsonl").read_text()
            == (tmp_path / "clean" / "rejects.jsonl").read_text())

    def batches(out):  # the same windows, batched the same way
        lines = [json.loads(x) for x in (out / "latencies.jsonl").read_text().splitlines()]
        return [(x["first"], x["bucket"], x["records"]) for x in lines]

    assert batches(tmp_path / "out") == batches(tmp_path / "clean")
    read_from = [json.loads(x)["read_from"] for x in journal.read_text().splitlines()]
    assert set(read_from) <= {0, 48, 96, 144, 192}  # every shard re-read from a window start


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_interrupted_by_a_signal_then_resumed_equals_an_uninterrupted_run(tmp_path, overlap):
    path = write_job(tmp_path, n=240, marker=150)
    (tmp_path / "stopping.py").write_text(STOPPING.format(encoder=str(ENCODER)))
    spec = load(path, "data.group_by_length=64", f"model.target={tmp_path / 'stopping.py'}:build")
    graphrun.run(spec, out=tmp_path / "clean", overlap=overlap)
    (tmp_path / "stop").touch()
    with pytest.raises(Interrupted):
        graphrun.run(spec, out=tmp_path / "out", overlap=overlap)
    stopped = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert stopped["status"] == "interrupted"
    # windows [0, 64) and [64, 128) written, the one holding the marker not: all of them
    # committed, the shard they end in committed open
    assert stopped["totals"]["records_out"] == 128
    graphrun.run(spec, out=tmp_path / "out", resume=True, overlap=overlap)
    assert_same_outputs(tmp_path / "clean", tmp_path / "out")


def test_grouping_without_a_variable_axis_is_one_spec_message():
    from graphrun.base.errors import SpecError

    with pytest.raises(SpecError, match="data.group_by_length.*has none"):
        graphrun.load_spec(ROOT / "pipelines/mlp-scorer.yaml", ["data.group_by_length=64"])
