"""feed_stream on the CPU, threaded (overlapped) and inline (serial): the same writes in the
same order, errors from either end raised without losing what came before, stops honoured, and
no thread left behind; the overlap's choice from run() and GRAPHRUN_OVERLAP."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from graphrun import GraphrunError, InputError, Runner
from graphrun.read.records import RecordBatch, Reject
from graphrun.engine.launch import SLOT_BUDGET, SLOTS, slot_count
from graphrun.feed.loop import feed_stream, overlap_choice
from graphrun.spec.keys import PipelineSpec


def mlp_spec(tmp_path) -> PipelineSpec:
    (tmp_path / "d.jsonl").write_text("")
    return PipelineSpec.model_validate({
        "version": 1, "name": "t", "device": "cpu",
        "model": {"builtin": "mlp",
                  "args": {"in_features": 4, "hidden": 8, "layers": 2, "out_features": 3}},
        "inputs": {"x": {"shape": ["batch", 4]}}, "outputs": {"y": {"shape": ["batch", 3]}},
        "buckets": {"batch": [1, 2, 4]},
        "data": {"path": str(tmp_path / "d.jsonl"), "oversize": "split"},
        "output": {"dir": str(tmp_path / "o")}})


class ListWriter:
    """Records the writer calls; optionally fails on the nth write."""

    def __init__(self, fail_at: int | None = None):
        self.calls: list = []
        self.fail_at = fail_at

    def write(self, indices, ids, outputs, batch_start=None):
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise OSError(28, "No space left on device")
        self.calls.append(("write", indices.tolist(), list(ids), outputs["y"].copy(),
                           batch_start))

    def reject(self, index, id, where, reason):
        self.calls.append(("reject", index, id, where, reason))


def batches(sizes: list[int], *, reject_every: int = 0, seed: int = 0) -> list[RecordBatch]:
    """Record batches of the given sizes with consecutive ordinals; every reject_every-th
    ordinal is a reject instead of a record."""
    rng = np.random.default_rng(seed)
    out, index = [], 0
    for size in sizes:
        indices, rejects = [], []
        while len(indices) < size or (size == 0 and not rejects):
            if reject_every and index % reject_every == reject_every - 1:
                rejects.append(Reject(index, index, f"d.jsonl:{index + 1}", "bad"))
            else:
                indices.append(index)
            index += 1
        idx = np.array(indices, dtype=np.int64)
        out.append(RecordBatch(indices=idx, ids=idx.tolist(), where=[""] * len(idx),
                               fields={"x": rng.standard_normal((len(idx), 4)).astype("f4")},
                               lengths={}, rejects=rejects))
    return out


def run(runner, source, writer, *, overlap, should_stop=lambda: False, reads=None):
    reads = [] if reads is None else reads
    return feed_stream(runner.launcher, source, writer, on_batches=lambda ran, n, first: None,
                         on_read=lambda rb: reads.append(len(rb)), should_stop=should_stop,
                         oversize=runner.spec.data.oversize, overlap=overlap)


def no_threads_left() -> bool:
    return not [t for t in threading.enumerate()
                if t.name in ("graphrun-stager", "graphrun-completer")]


@pytest.fixture
def runner(tmp_path):
    with Runner(mlp_spec(tmp_path)) as r:
        yield r


def test_overlapped_writes_what_serial_writes_in_the_same_order(runner):
    # more batches than slots; a batch split over the largest bucket; a batch of rejects only
    data = batches([3, 4, 7, 0, 1, 4, 2, 9, 4, 4, 3], reject_every=5)
    serial, overlapped = ListWriter(), ListWriter()
    run(runner, data, serial, overlap=False)
    host = run(runner, data, overlapped, overlap=True)
    assert len(serial.calls) == len(overlapped.calls) > 2 * SLOTS[0]
    for a, b in zip(serial.calls, overlapped.calls):
        assert a[:3] == b[:3] and a[-1] == b[-1]
        if a[0] == "write":
            np.testing.assert_array_equal(a[3], b[3])
    writes = [c for c in serial.calls if c[0] == "write"]
    assert [i for c in writes for i in c[1]] == [i for rb in data for i in rb.indices.tolist()]
    assert [c[1] for c in serial.calls if c[0] == "reject"] == \
        [r.index for rb in data for r in rb.rejects]
    # a split batch's parts all carry the batch's first covered ordinal, for --resume
    split = [c for c in writes if c[4] == writes[2][4]]
    assert sum(len(c[1]) for c in split) == 7
    # each record's output is the model's on that record alone
    x = np.concatenate([rb.fields["x"] for rb in data])
    want = runner.run_batch({"x": x[:4]})["y"]
    np.testing.assert_allclose(writes[0][3], want[:3], rtol=1e-5, atol=1e-6)
    assert set(host) == {"read", "stage", "read_wait", "launch", "device_wait", "write"}
    assert no_threads_left()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_writer_error_is_raised_and_nothing_after_it_is_written(runner, overlap):
    writer = ListWriter(fail_at=3)
    with pytest.raises(OSError, match="No space left"):
        run(runner, batches([4] * 20), writer, overlap=overlap)
    writes = [c for c in writer.calls if c[0] == "write"]
    assert [c[1][0] for c in writes] == [0, 4, 8]
    assert no_threads_left()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_bad_record_stops_the_run_after_writing_every_batch_before_it(runner, overlap):
    def source():
        yield from batches([4, 4, 3])
        raise InputError("record 'r11': x: value nan is NaN or Inf", where="d.jsonl:12")

    writer = ListWriter()
    with pytest.raises(InputError, match="r11"):
        run(runner, source(), writer, overlap=overlap)
    assert [i for c in writer.calls for i in c[1]] == list(range(11))
    assert no_threads_left()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_stop_finishes_the_batches_launched_and_reads_no_further(runner, overlap):
    reads: list = []
    writer = ListWriter()
    run(runner, batches([4] * 50), writer, overlap=overlap, reads=reads,
        should_stop=lambda: len(reads) >= 3)
    assert [c[1][0] for c in writer.calls] == [0, 4, 8] and len(reads) == 3
    assert no_threads_left()


def test_the_overlapped_path_keeps_at_most_slots_batches_in_flight(runner):
    held, most = set(), [0]
    stage, launch = runner.launcher.stage, runner.launcher.launch

    def staging(fields, n, lengths, slot, ids=None, indices=None):
        assert slot not in held, f"slot {slot} staged while still in flight"
        held.add(slot)
        most[0] = max(most[0], len(held))
        return stage(fields, n, lengths, slot, ids=ids, indices=indices)

    class Collecting:  # the launch's handle, its slot counted free once its result is taken
        def __init__(self, launched):
            self.launched = launched

        def result(self):
            out = self.launched.result()
            held.discard(self.launched.slot)
            return out

    runner.launcher.stage = staging
    runner.launcher.launch = lambda *a, **k: Collecting(launch(*a, **k))
    writer = ListWriter()
    run(runner, batches([4] * 40), writer, overlap=True)
    slots = slot_count(runner.launcher.slot_bytes)
    assert len(writer.calls) == 40 and 1 <= most[0] <= slots == runner.launcher.host_slots(1)


def test_slot_count_is_what_the_budget_holds_within_bounds():
    low, high = SLOTS
    assert slot_count(1000) == high
    assert slot_count(SLOT_BUDGET // (high - 1)) == high - 1
    assert slot_count(SLOT_BUDGET) == low  # a huge bucket: still enough slots to overlap


def test_after_a_write_fails_nothing_queued_behind_it_is_written():
    """The launching thread has seen (and cleared) the error while batches are still queued:
    those must not be written, or the output would skip the failed batch's rows."""
    from graphrun.feed.completer import Completer
    from graphrun.feed.protocols import Work
    from graphrun.feed.handoff import SlotPool

    cleared, waited = threading.Event(), []

    class Launched:
        def __init__(self, k: int):
            self.k = k

        def wait(self):  # the completer waits for a failed run's next batch
            waited.append(self.k)
            cleared.wait(5)
            return {}

        def result(self):
            return {"y": np.zeros((2, 3))}, {}

    writer = ListWriter(fail_at=0)
    pool = SlotPool(4)
    done = Completer(writer, pool, lambda *a: None, dict.fromkeys(
        ("device_wait", "write"), 0.0), threaded=True)
    for k in range(4):
        pool.acquire()
        item = Work("graph", 2, np.array([2 * k, 2 * k + 1]), [2 * k, 2 * k + 1], slot=k)
        done.collect(item, Launched(k))
    while not waited:  # the first write failed; the second batch is being waited for
        time.sleep(0.001)
    with pytest.raises(OSError):
        done.reject(Reject(99, 99, "", "bad"))  # the launching thread sees the error
    cleared.set()
    done.close()
    assert writer.calls == [] and len(waited) == 3
    assert sorted(pool.acquire() for _ in range(4)) == [0, 1, 2, 3]  # every slot freed


@pytest.mark.parametrize("word,want", [("on", True), ("1", True), ("TRUE", True), ("off", False),
                                       ("0", False), ("auto", None), ("", None)])
def test_the_overlap_is_the_callers_else_the_environments(monkeypatch, word, want):
    """run()'s overlap wins; else GRAPHRUN_OVERLAP; auto or unset: None (the device decides)."""
    monkeypatch.setenv("GRAPHRUN_OVERLAP", word)
    assert overlap_choice(None) is want
    assert overlap_choice(True) is True and overlap_choice(False) is False


@pytest.mark.parametrize("overlap", ["measure", "sometimes"])
def test_an_unknown_overlap_is_refused(monkeypatch, overlap):
    with pytest.raises(GraphrunError, match="is not one of True, False, None"):
        overlap_choice(overlap)
    monkeypatch.setenv("GRAPHRUN_OVERLAP", overlap)
    with pytest.raises(GraphrunError, match=f"GRAPHRUN_OVERLAP='{overlap}' is not one of on, "
                                            "off, auto"):
        overlap_choice(None)


def interrupt_at(n: int, call) -> bool:
    """call() with a KeyboardInterrupt raised at its n-th line event on this thread (in the
    completer's code or the queue and lock code it runs), as a second SIGINT or SIGTERM raises
    one between any two lines of the main thread. True: it was raised."""
    import sys

    seen = [0]

    def tracer(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == n:
                raise KeyboardInterrupt
        return tracer

    sys.settrace(tracer)
    try:
        call()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def test_a_submission_cut_by_an_interrupt_never_leaves_drain_or_close_waiting():
    """A KeyboardInterrupt raised anywhere in the launching thread's hand-off of a job (queue
    code included) must leave drain() and close() able to return: a job left queued with its
    consumer never woken had a stopping worker wait in close for good, holding the lock."""
    from graphrun.feed.completer import Completer
    from graphrun.feed.handoff import SlotPool

    n, cut = 1, 0
    while True:
        writer = ListWriter()
        done = Completer(writer, SlotPool(1), lambda *a: None,
                         dict.fromkeys(("device_wait", "write"), 0.0), threaded=True)
        done.reject(Reject(0, 0, "d.jsonl:1", "bad"))
        hit = interrupt_at(n, lambda: done.reject(Reject(1, 1, "d.jsonl:2", "bad")))
        ended = threading.Event()

        def finish():
            done.drain()
            done.close()
            ended.set()

        threading.Thread(target=finish, daemon=True).start()
        assert ended.wait(10), f"drain or close waited for good after an interrupt at line {n}"
        assert [c[1] for c in writer.calls] in ([0], [0, 1])
        if not hit:
            break
        n, cut = n + 1, cut + 1
    assert cut >= 1
