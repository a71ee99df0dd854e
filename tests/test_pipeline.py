"""`graphrun run` end to end on the CPU: every shipped pipeline's outputs equal a plain eager
loop over each record alone and unpadded; the manifest validates and its counts add up."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

import graphrun
from graphrun.job.parts import JobParts
from graphrun.job.state import RunHashes
from graphrun.models.load import build_model
from graphrun.write.folder import FilesHash, model_files
from graphrun.write.journal import InputHash

ROOT = Path(__file__).resolve().parent.parent
# the real-model pipelines (Hugging Face, timm) have their own tests: tests/test_real_models.py
PIPELINES = sorted(p for p in (ROOT / "pipelines").glob("*.yaml")
                   if not any(k in p.read_text() for k in ("  hf:", "  timm:")))
MANIFEST_SCHEMA = json.loads((ROOT / "schemas" / "manifest.schema.json").read_text())


def read_outputs(out: Path, fmt: str, names: list[str]) -> tuple[list, dict[str, list]]:
    """ids and per-record outputs from every shard, in order."""
    ids, outs = [], {n: [] for n in names}
    if fmt == "npy":
        for ids_file in sorted(out.glob("part-*.ids.npy")):
            ids += np.load(ids_file).tolist()
            stem = ids_file.name[: -len(".ids.npy")]
            for n in names:
                outs[n] += list(np.load(out / f"{stem}.{n}.npy"))
    else:
        for shard in sorted(out.glob("part-*.jsonl")):
            for line in shard.read_text().splitlines():
                rec = json.loads(line)
                ids.append(rec["id"])
                for n in names:
                    outs[n].append(np.asarray(rec[n]))
    return ids, outs


def records_of(spec) -> list[dict]:
    path = spec.data.path
    if path.suffix == ".npy":
        arr = np.load(path)
        return [{"id": i, next(iter(spec.inputs)): row} for i, row in enumerate(arr)]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("path", PIPELINES, ids=[p.stem for p in PIPELINES])
def test_shipped_pipeline_equals_eager_per_record(path, tmp_path):
    n = 150
    spec = graphrun.load_spec(path, ["data.batch_size=8"])  # several batches and buckets
    manifest = graphrun.run(spec, out=tmp_path / "out", stop=n)
    out = tmp_path / "out"
    names = list(spec.outputs)
    ids, outs = read_outputs(out, spec.output.format, names)
    records = records_of(spec)[:n]
    want_ids = [r.get(spec.data.id_field, i) if spec.data.id_field else i
                for i, r in enumerate(records)]
    assert ids == want_ids
    model = build_model(spec, torch.device("cpu"), spec.base_dir)
    with torch.inference_mode():
        for i, rec in enumerate(records):
            inputs = {k: torch.as_tensor(np.asarray(rec[k]))[None].to(
                graphrun.base.dtypes.torch_dtype(spec.inputs[k].dtype)) for k in spec.inputs}
            got = graphrun.models.call.name_outputs(
                graphrun.models.call.call_model(model, inputs, spec.model.call), names)
            for name in names:
                np.testing.assert_allclose(outs[name][i], got[name][0].float().numpy(),
                                           rtol=1e-4, atol=1e-4, err_msg=f"{name} of record {i}")
    t = manifest.totals
    assert t.records_in == n == t.records_out + t.records_rejected
    assert manifest.status == "completed"
    on_disk = json.loads((out / "manifest.json").read_text())
    jsonschema.validate(on_disk, MANIFEST_SCHEMA)
    assert sum(f["rows"] for f in on_disk["files"] if "ids" in f["path"] or
               f["path"].endswith((".jsonl", ".parquet"))) == n
    lat = [json.loads(l) for l in (out / "latencies.jsonl").read_text().splitlines()]
    assert len(lat) == t.batches and sum(l["records"] for l in lat) == n
    assert all(lane["verify"] is None or lane["verify"]["passed"]
               for b in on_disk["buckets"] for lane in b["lanes"])


def test_existing_output_folder_is_not_clobbered(tmp_path):
    spec = graphrun.load_spec(PIPELINES[0])
    graphrun.run(spec, out=tmp_path / "o", stop=10)
    with pytest.raises(graphrun.OutputError, match="--resume .* or --overwrite"):
        graphrun.run(spec, out=tmp_path / "o", stop=10)
    m = graphrun.run(spec, out=tmp_path / "o", stop=12, overwrite=True)
    assert m.totals.records_out == 12


@pytest.mark.parametrize("fmt", ["npy", "jsonl", "parquet"])
def test_overlapped_and_serial_paths_write_the_same_files(tmp_path, fmt):
    """Forced overlapped, forced serial, and the CPU's default (serial): the same files."""
    spec = graphrun.load_spec(ROOT / "pipelines" / "decoder-step.yaml",
                              ["data.batch_size=5", f"output.format={fmt}",
                               "output.rows_per_file=37"])
    runs = {}
    for overlap in (True, False, None):
        out = tmp_path / f"overlap-{overlap}"
        m = graphrun.run(spec, out=out, stop=300, overlap=overlap)
        assert m.totals.records_out == 300 and m.totals.batches == 60
        assert m.totals.overlapped is (overlap is True)
        runs[overlap] = {p.name: p.read_bytes() for p in sorted(out.glob("part-*"))}
    assert len(runs[True]) >= 9 and runs[True] == runs[False] == runs[None]


def test_the_first_batch_is_read_while_the_runner_sets_up(tmp_path):
    import threading

    from graphrun.engine import Runner
    from graphrun.read.stream import read_batches

    read, seen = threading.Event(), []

    def reading(*args, **kwargs):
        for batch in read_batches(*args, **kwargs):
            read.set()
            yield batch

    class SlowSetup(Runner):
        def __init__(self, *args, **kwargs):
            seen.append(read.wait(10))  # set only if reading began before setup was over
            super().__init__(*args, **kwargs)

    spec = graphrun.load_spec(ROOT / "pipelines" / "decoder-step.yaml", ["data.batch_size=8"])
    m = graphrun.run(spec, out=tmp_path / "o", stop=100,
                     parts=JobParts(read_batches=reading, runner=SlowSetup))
    assert seen == [True] and m.totals.records_out == 100 and m.totals.batches == 13


def test_a_failed_setup_stops_the_read_ahead(tmp_path):
    import threading

    def broken(*args, **kwargs):
        raise graphrun.CaptureError("the model cannot be captured")

    spec = graphrun.load_spec(ROOT / "pipelines" / "decoder-step.yaml")
    with pytest.raises(graphrun.CaptureError, match="cannot be captured"):
        graphrun.run(spec, out=tmp_path / "o", parts=JobParts(runner=broken))
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["totals"]["records_out"] == 0
    assert not [t for t in threading.enumerate() if t.name == "graphrun-read-ahead"]


def test_phases_are_timed_on_a_sample_and_e2e_on_every_batch(tmp_path):
    from functools import partial

    from graphrun.engine import Runner
    from graphrun.engine.timing import sampled

    spec = graphrun.load_spec(ROOT / "pipelines" / "decoder-step.yaml", ["data.batch_size=8"])
    every_third = partial(sampled, first=4, every=3)
    m = graphrun.run(spec, out=tmp_path / "o", stop=200,
                     parts=JobParts(runner=partial(Runner, sampled=every_third)))
    lines = [json.loads(x) for x in (tmp_path / "o" / "latencies.jsonl").read_text().splitlines()]
    assert len(lines) == m.totals.batches == 25
    assert all(line["e2e_us"] > 0 for line in lines)
    timed = [i for i, line in enumerate(lines) if "replay_us" in line]
    assert timed == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24]  # one bucket: batch=8
    assert all(lines[i]["h2d_us"] >= 0 and lines[i]["d2h_us"] >= 0 for i in timed)
    (bucket,) = [b for b in m.buckets if b.batches]
    assert set(bucket.latency_us) == {"h2d", "replay", "d2h", "e2e"}


@pytest.mark.parametrize("overlap", [True, False])
def test_the_overlapped_paths_slots_are_made_before_the_stream_starts(tmp_path, overlap):
    """Pinned slots cost milliseconds to allocate on a GPU, a few percent of a 1M-record MLP
    stream: they are made with the runner, before the streaming time starts."""
    from graphrun.feed.loop import feed_stream
    from graphrun.engine.launch import slot_count

    seen = []

    def counting(engine, *args, **kwargs):
        seen.append((len(engine.slots), slot_count(engine.slot_bytes)))
        return feed_stream(engine, *args, **kwargs)

    spec = graphrun.load_spec(ROOT / "pipelines" / "decoder-step.yaml")
    m = graphrun.run(spec, out=tmp_path / "o", stop=50, overlap=overlap,
                     parts=JobParts(feed_stream=counting))
    assert m.totals.records_out == 50 and len(seen) == 1
    made, wanted = seen[0]
    assert made == (1 if overlap is False else wanted) and wanted >= 3


def decoder_spec(*overrides):
    return graphrun.load_spec(ROOT / "pipelines" / "decoder-step.yaml",
                              ["data.batch_size=5", "output.rows_per_file=37", *overrides])


def hashed_by(input_hash: type[InputHash], spec) -> RunHashes:
    """The run's own digests (RunHashes.own), its input's by input_hash: InputHash with its
    _hash slowed down or stuck, its thread and stop() as a run's own."""
    return RunHashes(input_hash(Path(spec.data.path)),
                     FilesHash(model_files(spec.model, spec.base_dir)))


class StuckHash(InputHash):
    """Hashing a huge file: it only ends when told to stop."""

    def _hash(self):
        while not self._stop.wait(0.01):
            pass


def test_the_input_is_hashed_beside_setup_and_in_run_json_before_the_first_journal_line(
        tmp_path):
    import threading
    import time
    from functools import partial

    from graphrun.engine import Runner
    from graphrun.write import journal
    from graphrun.write.shards import DiskSteps, ShardWriter

    spec = decoder_spec()
    want = journal.sha256_file(spec.data.path)
    times, seen = {}, []

    class SlowHash(InputHash):
        def _hash(self):  # 0.3 s late: setup must not wait for it
            time.sleep(0.3)
            super()._hash()
            times["hashed"] = time.perf_counter()

    def runner(*a, **k):
        times.setdefault("setup", time.perf_counter())
        return Runner(*a, **k)

    def append(out_dir, *a, **k):  # what run.json says as each journal line is appended
        seen.append(json.loads((out_dir / "run.json").read_text())["input_sha256"])
        return journal.append_journal(out_dir, *a, **k)

    writer = partial(ShardWriter, disk=DiskSteps(append_journal=append))
    m = graphrun.run(spec, out=tmp_path / "o", stop=300, overlap=False,
                     hashes=hashed_by(SlowHash, spec),
                     parts=JobParts(runner=runner, writer=writer))
    assert times["setup"] < times["hashed"]  # setup started while the input was hashed
    assert len(seen) == 9 and seen == [want] * 9  # 300 rows in shards of 37
    assert m.input["sha256"] == want
    assert json.loads((tmp_path / "o" / "run.json").read_text())["input_sha256"] == want
    assert m.totals.wall_s >= m.totals.setup_s + m.totals.stream_s
    assert not [t for t in threading.enumerate() if t.name == "graphrun-input-hash"]


def test_a_run_stopped_before_its_input_was_hashed_is_resumed_from_the_start(tmp_path):
    """run.json without the input's hash: the run committed nothing (the hash is written
    before the first journal line), so --resume starts over in the folder."""
    spec = decoder_spec()
    clean = graphrun.run(spec, out=tmp_path / "clean", stop=100)
    out = tmp_path / "o"
    out.mkdir()
    run_json = json.loads((tmp_path / "clean" / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**run_json, "input_sha256": None}))
    (out / "manifest.json").write_text(json.dumps({"status": "interrupted"}))
    m = graphrun.run(spec, out=out, stop=100, resume=True)
    assert m.status == "completed" and m.totals.records_out == 100
    assert json.loads((out / "run.json").read_text()) == run_json
    assert [f.sha256 for f in m.files] == [f.sha256 for f in clean.files]
    # with a journal line, a run.json without the hash is not trusted
    (out / "run.json").write_text(json.dumps({**run_json, "input_sha256": None}))
    with pytest.raises(graphrun.OutputError, match="input_sha256 changed"):
        graphrun.run(spec, out=out, stop=100, resume=True)


def test_a_failed_setup_does_not_wait_for_the_input_hash(tmp_path):
    import threading
    import time

    def failing_runner(*a, **k):
        raise graphrun.ModelError("model: the build failed")

    spec = decoder_spec()
    t0 = time.perf_counter()
    with pytest.raises(graphrun.ModelError):
        graphrun.run(spec, out=tmp_path / "o", hashes=hashed_by(StuckHash, spec),
                     parts=JobParts(runner=failing_runner))
    assert time.perf_counter() - t0 < 10
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert m["status"] == "failed" and m["input"]["sha256"] is None
    assert json.loads((tmp_path / "o" / "run.json").read_text())["input_sha256"] is None
    assert not [t for t in threading.enumerate() if t.name == "graphrun-input-hash"]


def test_a_failure_counting_the_records_stops_the_input_hash(tmp_path):
    import threading

    def bad_count(*a, **k):
        raise graphrun.InputError("line 7: not JSON", where="decode.jsonl:7")

    spec = decoder_spec()
    with pytest.raises(graphrun.InputError, match="not JSON"):
        graphrun.run(spec, out=tmp_path / "o", show=True, hashes=hashed_by(StuckHash, spec),
                     parts=JobParts(count_records=bad_count))
    assert not [t for t in threading.enumerate() if t.name == "graphrun-input-hash"]


def test_the_summary_names_reading_as_the_limit_where_it_is():
    from types import SimpleNamespace

    from graphrun.job.progress import stream_breakdown

    def totals(read: float, write: float, out: int = 100):
        return SimpleNamespace(stream_s=10.0, overlapped=True, records_out=out, host_phase_s={
            "read": read, "stage": 1.0, "launch": 2.0, "device_wait": 9.5, "write": write})

    text = stream_breakdown(totals(read=9.0, write=1.0), "data/in.parquet")
    assert "busiest: read (reading the input limits the rate: write row groups of at most " \
           "65,536 records" in text
    assert stream_breakdown(totals(read=1.0, write=6.0), "in.parquet").endswith("busiest: write")
    # a JSONL input's advice is JSONL's; with every record rejected, reading is all that ran
    text = stream_breakdown(totals(read=9.0, write=1.0), "in.jsonl")
    assert "row groups" not in text and ("orjson" in text or "binary format" in text)
    assert stream_breakdown(totals(read=9.0, write=0.0, out=0), "in.jsonl").endswith(
        "busiest: read")
    # serially, a read of 1% beside the device's 98%: the device is the busiest, no advice
    gen = SimpleNamespace(stream_s=10.0, overlapped=False, records_out=4, host_phase_s={
        "read": 0.1, "stage": 0.01, "launch": 0.05, "device_wait": 9.8, "write": 0.02})
    assert stream_breakdown(gen, "in.jsonl").endswith("busiest: the device")
