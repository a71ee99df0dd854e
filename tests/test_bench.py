"""graphrun bench: every bucket in every mode, bench.json against its schema, the CPU note."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from click.testing import CliRunner

import graphrun
from graphrun.experiments.bench import SCHEMA, bench, schema_text, synthetic_batch
from graphrun.cli.main import main


def test_the_checked_in_schema_is_current():
    assert SCHEMA.read_text() == schema_text(), (
        "stale: python3 -c 'from graphrun.experiments.bench import *; SCHEMA.write_text(schema_text())'")


def test_synthetic_batches_fill_the_bucket_within_ranges(write_spec):
    spec = graphrun.load_spec(write_spec())
    spec = spec.model_copy(update={"inputs": {"x": spec.inputs["x"].model_copy(
        update={"dtype": "int64", "range": (3, 7)})}})
    a, b = (synthetic_batch(spec, {"batch": 4}, seed)["x"] for seed in (0, 1))
    assert a.shape == (4, 4) and a.dtype == np.int64 and a.min() >= 3 and a.max() < 7
    assert not np.array_equal(a, b)  # distinct inputs per seed



def test_the_bench_s_batch_is_the_verification_s_values(write_spec):
    # one rule for synthetic inputs: what bench times is what verify checks, seed for seed
    from graphrun.engine.verify import fill_synthetic

    spec = graphrun.load_spec(write_spec())
    spec = spec.model_copy(update={"inputs": {
        "x": spec.inputs["x"].model_copy(update={"dtype": "int64", "range": (3, 7)}),
        "m": spec.inputs["x"].model_copy(update={"dtype": "bool", "range": None})}})
    views = {"x": torch.empty(4, 4, dtype=torch.int32), "m": torch.empty(4, 4, dtype=torch.bool)}
    fill_synthetic(views, spec.inputs, torch.Generator().manual_seed(5))
    batch = synthetic_batch(spec, {"batch": 4}, 5)
    assert batch["m"].dtype == bool and np.array_equal(batch["m"], views["m"].numpy())
    assert np.array_equal(batch["x"], views["x"].numpy().astype(np.int64))

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's eager-only bench")
def test_cli_bench_on_the_cpu_times_every_bucket_eagerly_and_says_so(write_spec, tmp_path):
    spec = write_spec()
    result = CliRunner().invoke(main, ["bench", str(spec), "--iters", "3", "--warmup", "1",
                                       "--out", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "b" / "bench.json").read_text())
    jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
    assert [b["name"] for b in doc["buckets"]] == ["batch=1", "batch=2", "batch=4"]
    assert doc["repeats"] == 2  # the CPU's default
    for b in doc["buckets"]:
        (mode,) = b["modes"]
        assert mode["mode"] == "eager" and mode["speedup"] == 1.0
        assert mode["verify"] is None  # nothing captured: nothing to check
        assert 0 < mode["latency_us"]["p50"] <= mode["latency_us"]["p99"]
        spread = mode["p50_spread_us"]
        assert spread["n"] == 2 and len(spread["values"]) == 2
        assert spread["min"] <= spread["median"] <= spread["max"]
        assert b["fastest"] is None  # one mode: nothing to rank
    assert "graph replay not measured" in doc["notes"][0]
    assert "note: no CUDA device" in result.output and "batch=4" in result.output
    assert not list((tmp_path / "b").glob("part-*"))  # no output shards


@pytest.mark.cuda
def test_bench_on_the_gpu_times_graph_replay_with_capture_costs(write_spec):
    spec = graphrun.load_spec(write_spec(), ["device=cuda"])
    result = bench(spec, iters=20, warmup=3, compile=True, log=lambda m: None)
    for b in result.buckets:
        modes = {m.mode: m for m in b.modes}
        assert set(modes) == {"eager", "graph", "compile", "reduce-overhead"}
        assert modes["graph"].backend == "cuda-graph" and modes["graph"].verify is True
        assert modes["graph"].capture_s > 0 and modes["graph"].memory_bytes is not None
        assert modes["graph"].speedup > 0 and modes["graph"].p50_spread_us.n == 3
        assert b.fastest is not None and b.fastest.best in modes
    assert result.repeats == 3  # the GPU's default


def test_real_records_are_cut_or_padded_to_the_bucket(tmp_path):
    from graphrun.experiments.bench import real_batch, real_records
    from tests.test_plan import write_encoder

    spec = graphrun.load_spec(write_encoder(tmp_path, [3, 20, 5]))
    records = real_records(spec, 2)
    assert [len(r) for r in records["tokens"]] == [3, 20]  # the first 2 only
    batch = real_batch(spec, records, {"batch": 4, "seq": 8}, first=1)
    mask = batch["mask"]
    assert mask.shape == (4, 8) and batch["tokens"].dtype == np.int64
    # rows: records 1 (cut to 8), 0 (padded with 0 after 3), 1, 0
    assert mask.sum(axis=1).tolist() == [8, 3, 8, 3]
    assert batch["tokens"][1, :3].tolist() == [0, 0, 0] and batch["tokens"][0, 0] == 1


def test_cli_bench_with_real_records(write_spec, tmp_path):
    result = CliRunner().invoke(main, ["bench", str(write_spec()), "--iters", "2", "--records",
                                       "5", "--out", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert doc["inputs"] == "the first 5 real records" and len(doc["buckets"]) == 3


def test_repeats_alternate_the_modes_bucket_by_bucket():
    from graphrun.experiments.bench import Session, round_robin

    calls = []
    sessions = [Session(m, steps={"b1": None, "b2": None}) for m in ("eager", "graph")]
    got = round_robin(sessions, ["b1", "b2"], 2,
                      lambda s, key: calls.append((s.mode, key)) or len(calls), [],
                      lambda m: None)
    assert calls == [("eager", "b1"), ("graph", "b1"), ("eager", "b2"), ("graph", "b2")] * 2
    assert got["graph"]["b2"] == [4, 8] and got["eager"]["b1"] == [1, 5]
    # a long repeat says how far the whole bench is: a later repeat's start is no "0 of 2"
    said = []
    round_robin(sessions, ["b1", "b2"], 2, lambda s, key: 0, [], said.append, every_s=0)
    progress = [line for line in said if "so far" in line]
    assert [line.split(",")[0] for line in progress] == [
        f"bench: {done} of 4 bucket timings done (repeat {r}/2)"
        for done, r in ((0, 1), (1, 1), (2, 2), (3, 2))]
    assert all(line.endswith(" s so far") for line in progress)


def test_the_fastest_mode_is_named_only_beyond_the_noise():
    from graphrun.experiments.bench import ModeResult, judge
    from graphrun.experiments.stats import spread

    def mode(name, p50s):
        return ModeResult(mode=name, backend=name, latency_us={"p50": 0.0},
                          p50_spread_us=spread(p50s))

    apart = [mode("eager", [100, 104, 102]), mode("graph", [20, 21, 22])]
    v = judge(apart)
    assert v.winner == "graph" and apart[1].speedup == pytest.approx(102 / 21)
    assert apart[1].speedup_beyond_noise is True and apart[0].speedup_beyond_noise is None
    close = [mode("eager", [100, 130, 115]), mode("graph", [90, 120, 110])]
    v = judge(close)
    assert v.winner is None and v.within_noise == ["graph", "eager"]
    assert "no significant difference" in v.text and close[1].speedup_beyond_noise is False
    few = [mode("eager", [100, 101]), mode("graph", [20, 21])]  # 2 repeats: no winner
    assert judge(few).winner is None and "--repeats 3" in judge(few).text


@pytest.mark.parametrize("when", ["setting up", "timed"])
def test_a_failing_mode_is_a_note_not_the_end(write_spec, when):
    from graphrun.experiments import bench

    real = bench.open_graphrun

    def failing(stack, spec, mode, batches):
        if mode == "compile" and when == "setting up":
            raise RuntimeError("inductor exploded\nmore lines")
        if mode == "compile":  # the plain model stands in: what is tested is the bench's part
            spec = bench._with(spec, "model", compile=False)
        session = real(stack, spec, mode, batches)
        if mode == "compile":  # its second bucket's step fails
            session.steps["batch=2"] = lambda batch: (_ for _ in ()).throw(
                RuntimeError("inductor exploded\nmore lines"))
        return session

    result = bench.bench(graphrun.load_spec(write_spec()), iters=2, warmup=0, compile=True,
                         repeats=2, log=lambda m: None, open_graphrun=failing)
    assert "compile failed: RuntimeError: inductor exploded" in result.notes
    # a mode failing part-way is dropped whole: no bucket keeps its half-done timings
    assert all([m.mode for m in bk.modes] == ["eager"] for bk in result.buckets)


@pytest.fixture
def generation_spec(tmp_path):
    from tests.test_generate_job import write_spec as write_generation_spec

    return write_generation_spec(tmp_path, n=4, buckets={"batch": [1, 2], "seq": [8, 16]})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's eager-only bench")
def test_bench_of_a_generation_spec_times_prefill_and_decode_per_bucket(generation_spec,
                                                                       tmp_path):
    result = CliRunner().invoke(main, ["bench", str(generation_spec), "--iters", "2",
                                       "--warmup", "0", "--new-tokens", "3",
                                       "--out", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "b" / "bench.json").read_text())
    jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
    assert doc["new_tokens"] == 3
    assert [b["name"] for b in doc["buckets"]] == [
        "batch=1,seq=8", "batch=1,seq=16", "batch=2,seq=8", "batch=2,seq=16"]
    for b in doc["buckets"]:
        (mode,) = b["modes"]
        assert (mode["mode"], mode["backend"], mode["speedup"]) == ("eager", "eager", 1.0)
        assert mode["output_tokens_per_s"] > 0
        assert set(mode["ttft_ms"]) == set(mode["tpot_ms"]) == {"p50", "p90", "p99"}
        assert 0 < mode["ttft_ms"]["p50"] <= mode["latency_us"]["p99"] / 1e3
        assert mode["output_tokens_per_s_spread"]["n"] == mode["p50_spread_us"]["n"] == 2
    assert "every row makes 3 new tokens" in doc["notes"][0]
    assert "graph replay not measured" in doc["notes"][1]
    assert "TTFT p50 ms" in result.output and "batch=2,seq=16" in result.output
    assert not list((tmp_path / "b").glob("part-*"))


def test_a_generations_tokens_per_s_counts_every_rows_new_tokens(generation_spec):
    from graphrun.experiments.bench_generate import bench_generation, synthetic_prompts

    spec = graphrun.load_spec(generation_spec, ["buckets.batch=[2]", "buckets.seq=[8]"])
    result = bench_generation(spec, iters=2, warmup=0, new_tokens=2, repeats=1,
                              log=lambda m: None)
    (mode,) = result.buckets[0].modes
    calls_s = mode.latency_us["p50"] / 1e6  # two calls: p50 is their mean
    assert mode.output_tokens_per_s == pytest.approx(2 * 2 / calls_s, rel=1e-6)
    a = synthetic_prompts(2, 8, 512, seed=0)
    assert a == synthetic_prompts(2, 8, 512, seed=0) != synthetic_prompts(2, 8, 512, seed=1)
    assert [len(p) for p in a] == [8, 8] and min(min(p) for p in a) >= 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's modes")
@pytest.mark.parametrize("broken", [False, True], ids=["compiles", "compiler-fails"])
def test_bench_compile_on_a_generation_spec_times_the_compiled_steps(generation_spec, tmp_path,
                                                                     monkeypatch, broken):
    from graphrun.generate import compiled

    def call(self, tokens, positions, kv):  # the compiler's own run is the slow test's
        if broken:
            raise RuntimeError("inductor exploded")
        return self.plain(tokens, positions, kv)

    # a patch: `graphrun bench` builds its own engines, reached only through the command
    monkeypatch.setattr(compiled.CompiledStep, "__call__", call)
    result = CliRunner().invoke(main, ["bench", str(generation_spec), "--iters", "2",
                                       "--warmup", "0", "--new-tokens", "3", "--compile",
                                       "--out", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "b" / "bench.json").read_text())
    jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
    for b in doc["buckets"]:
        modes = {m["mode"]: m["backend"] for m in b["modes"]}
        assert modes == {"eager": "eager",
                         "compile": "eager" if broken else "eager + torch.compile"}
    failed = [n for n in doc["notes"] if "inductor exploded" in n]
    assert len(failed) == (1 if broken else 0)  # once, naming the first graph
    if broken:
        assert failed[0].startswith("compile: prefill tokens=8 and others like it: ")


@pytest.mark.parametrize("args, says", [
    (["--records", "4"], "graphrun bench --records: a generation spec is timed on synthetic"),
])
def test_bench_options_a_generation_spec_cannot_take_are_one_message(generation_spec, args,
                                                                     says):
    result = CliRunner().invoke(main, ["bench", str(generation_spec), *args])
    assert result.exit_code == 2 and says in result.output, result.output
    assert "Traceback" not in result.output


def test_new_tokens_on_a_forward_spec_is_one_message(write_spec):
    result = CliRunner().invoke(main, ["bench", str(write_spec()), "--new-tokens", "4"])
    assert result.exit_code == 2, result.output
    assert "--new-tokens: only a generation spec (one with generate:) makes new tokens" \
        in result.output


@pytest.mark.parametrize("plant, out, says", [
    (lambda d: (d / "bench.json").mkdir(parents=True), "b",
     "b/bench.json is a folder, not a file: remove it, or give --out another folder"),
    (lambda d: d.write_text("x"), "b/sub", "b is a file, not a folder: give --out a folder"),
    (lambda d: (d.mkdir(), (d / "bench.json").symlink_to(d.parent / "elsewhere")), "b",
     "b/bench.json is a link"),
])
def test_an_out_that_cannot_take_bench_json_is_refused_before_the_timing(
        write_spec, tmp_path, monkeypatch, plant, out, says):
    """A folder named bench.json (or a link there, or a file above --out) was an
    IsADirectoryError's (an OutputError's) traceback after every bucket was timed."""
    import graphrun.experiments.bench as bench_module

    plant(tmp_path / "b")
    timed = []
    monkeypatch.setattr(bench_module, "bench", lambda *a, **k: timed.append(1))
    result = CliRunner().invoke(main, ["bench", str(write_spec()), "--iters", "1",
                                       "--warmup", "0", "--out", str(tmp_path / out)])
    assert result.exit_code == 2 and says in result.output, result.output
    assert "Traceback" not in result.output and not timed
    assert not (tmp_path / "elsewhere").exists()
