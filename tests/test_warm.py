"""The kernels' warm-up (models/causal/warm.py): begun once the model's layout is known (a
builtin's arguments, a checkpoint's config.json) and before its weights are made or read; a
no-op without CUDA; a failure only recorded; the engine waits for it before its first graph and
the manifest reports it. Under Triton's interpreter its tensors run the real kernels; on a GPU
it compiles what the engine's steps launch, and a job's tokens are the same with or without it."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from graphrun.generate.config import GenerateConfig
from graphrun.generate.engine import build_engine
from graphrun.models.causal.llama import build_llama, builtin_shape
from graphrun.models.causal.warm import Layout, WarmUp, layout_of

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "examples" / "models" / "tiny-llama"
PROMPTS = [[3, 8, 1], [9] * 12, [4, 5, 6, 7, 8], [2]]
TINY = dict(layers=2, d_model=64, heads=4, kv_heads=2, vocab=512, max_len=64)


class Recorded:
    """A warm-up stand-in that notes when the engine waits."""

    def __init__(self, calls: list, status: str = "done", reason: str | None = None):
        self.calls, self.status, self.reason = calls, status, reason

    def wait(self) -> None:
        self.calls.append("wait")


def test_without_cuda_it_is_skipped_and_the_wait_is_immediate():
    warm = WarmUp.begin(Layout(4, 2, 16, 64), torch.device("cpu"), torch.float32, 16)
    warm.wait()
    report = warm.report()
    assert (report["status"], report["reason"], report["kernels"]) == (
        "skipped", "no CUDA device", [])
    assert report["run_s"] is None and 0 <= report["wait_s"] < 0.5


def test_a_failure_is_recorded_not_raised():
    def broken():
        raise RuntimeError("ptxas: no such GPU\nmore lines")

    warm = WarmUp(broken)
    warm.wait()  # no exception here: the engine's steps compile anew
    assert warm.status == "failed" and warm.reason == "RuntimeError: ptxas: no such GPU"
    assert warm.run_s is not None and warm.report()["kernels"] == []


def test_the_wait_counts_the_first_wait_only():
    import threading

    go = threading.Event()
    warm = WarmUp(lambda: go.wait(5) and ["matmul"])
    threading.Timer(0.2, go.set).start()
    warm.wait()
    first = warm.wait_s
    warm.wait()
    assert first >= 0.1 and warm.wait_s == first and warm.kernels == ["matmul"]


def test_layouts_of_llama_and_gpt2_shapes():
    from graphrun.models.checkpoint import GPT2Shape

    assert layout_of(builtin_shape(**TINY)) == Layout(4, 2, 16, 64, "llama",
                                                     builtin_shape(**TINY).ffn)
    gpt2 = GPT2Shape(layers=2, d_model=64, heads=4, ffn=256, vocab=100, max_len=64)
    assert layout_of(gpt2) == Layout(4, 4, 16, 64, "gpt2")


def test_the_engine_waits_before_its_first_graph(monkeypatch):
    from graphrun.generate import graphs

    calls: list[str] = []
    prepare = graphs.GraphTable.prepare

    def noted(self, keys, how):
        calls.append("prepare")
        return prepare(self, keys, how)

    monkeypatch.setattr(graphs.GraphTable, "prepare", noted)
    eng = build_engine(build_llama(**TINY), GenerateConfig(max_new_tokens=4), slots=2,
                       max_prompt=16, block_size=4, warm=Recorded(calls))
    assert calls == ["wait", "prepare"] and eng.warm.calls is calls


def test_the_attention_plans_are_built_at_the_prefill_steps_own_shapes_and_strides(
        monkeypatch):
    """cuDNN keys a plan by its tensors' shapes, strides and dtypes: attention_plans' tensors
    must be the ones the engine's prefills hand to attention, at every packed size."""
    from graphrun.models.causal import kv_cache, warm

    real, seen = kv_cache.fresh_attend, []

    def noted(q, k, v, mask, scale, softcap=None):
        seen.append(tuple((tuple(t.shape), t.stride(), t.dtype) for t in (q, k, v, mask)))
        return real(q, k, v, mask, scale, softcap)

    monkeypatch.setattr(kv_cache, "fresh_attend", noted)
    monkeypatch.setattr(warm, "fresh_attend", noted)
    model = build_llama(**TINY)
    eng = build_engine(model, GenerateConfig(max_new_tokens=2), slots=4, max_prompt=16,
                       block_size=4, prefill_tokens=32)
    eng.generate(PROMPTS)
    eng.generate([[7] * 14, [1, 2]])
    steps = set(seen)
    sizes = sorted({q[0][2] for q, *_ in steps})
    assert len(sizes) >= 2 and set(sizes) <= set(eng.prefill_sizes)
    seen.clear()
    assert warm.attention_plans(layout_of(model.shape), torch.device("cpu"), torch.float32,
                                sizes) == len(sizes)
    assert set(seen) == steps
    seen.clear()  # built only until told to stop, the largest first
    assert warm.attention_plans(layout_of(model.shape), torch.device("cpu"), torch.float32,
                                sizes, until=lambda: len(seen) == 1) == 1
    assert [q[0][2] for q, *_ in seen] == [max(sizes)]


def test_a_failed_warm_up_is_said_and_the_tokens_are_the_same():
    said: list[str] = []
    config = GenerateConfig(max_new_tokens=6)
    model = build_llama(**TINY)
    plain = build_engine(model, config, slots=2, max_prompt=16, block_size=4)
    failed = build_engine(model, config, slots=2, max_prompt=16, block_size=4, log=said.append,
                          warm=Recorded([], "failed", "RuntimeError: boom"))
    assert [c.token_ids for c in failed.generate(PROMPTS)] == \
        [c.token_ids for c in plain.generate(PROMPTS)]
    assert any("warm-up failed" in line and "RuntimeError: boom" in line for line in said)


def test_the_layout_is_known_before_the_weights(monkeypatch, tmp_path):
    """A builtin's shape from its arguments before it is built; a checkpoint's from its
    config.json before its tensors are read."""
    from graphrun.generate import runner

    seen = []
    spec = builtin_spec(tmp_path)
    llama = runner.BUILTINS["llama"]
    monkeypatch.setitem(runner.BUILTINS, "llama", dataclasses.replace(
        llama, builder=lambda **kw: (seen.append("build"), llama.builder_function()(**kw))[1]))
    model, _ = runner.build_generation_model(spec, torch.device("cpu"),
                                             layout_known=seen.append)
    assert seen == [builtin_shape(**TINY), "build"] and model.shape == seen[0]

    pytest.importorskip("safetensors")
    import graphrun

    seen.clear()
    load = runner.load_checkpoint
    monkeypatch.setattr(runner, "load_checkpoint",
                        lambda *a: (seen.append("load"), load(*a))[1])
    spec = graphrun.load_spec(write_spec(tmp_path, {"hf": {"path": str(FOLDER), "class":
                                                           "AutoModelForCausalLM"},
                                                    "dtype": "float32"}))
    model, code = runner.build_generation_model(spec, torch.device("cpu"),
                                                layout_known=seen.append)
    assert code[0] == "graphrun" and seen == [model.shape, "load"]


def test_a_job_reports_its_warm_up_and_the_wait_phase(tmp_path):
    pytest.importorskip("tokenizers")
    import graphrun

    manifest = graphrun.run(builtin_spec(tmp_path))
    warm = manifest.generation.warm_up
    assert warm is not None and (warm.status, warm.reason) == ("skipped", "no CUDA device")
    phases = json.loads((tmp_path / "out" / "manifest.json").read_text())["phases"]
    assert "kernel warm-up" in {p["name"] for p in phases["top"]}


def test_off_begins_none_and_other_values_are_refused(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    import graphrun
    from graphrun.base import envs
    from graphrun.base.errors import GraphrunError

    monkeypatch.setenv("GRAPHRUN_KERNEL_WARM_UP", "off")
    assert graphrun.run(builtin_spec(tmp_path)).generation.warm_up is None
    with pytest.raises(GraphrunError, match="GRAPHRUN_KERNEL_WARM_UP='maybe': set on or off"):
        envs.switch("GRAPHRUN_KERNEL_WARM_UP", True, {"GRAPHRUN_KERNEL_WARM_UP": "maybe"})


class Started:
    """A DeviceStart stand-in: the device, once asked."""

    def __init__(self, device: str = "cpu"):
        self.device, self.asked = torch.device(device), 0

    def wait(self) -> torch.device:
        self.asked += 1
        return self.device


def test_one_begun_at_the_start_is_the_one_the_runner_claims(tmp_path):
    pytest.importorskip("tokenizers")
    from graphrun.generate.runner import GenerationRunner, begin_warm_up, warm_up_key
    from graphrun.models.causal import warm

    spec = builtin_spec(tmp_path)
    started = Started()
    begin_warm_up(spec, started)
    early = warm._EARLY[warm_up_key(spec)]
    begin_warm_up(spec, Started())  # once per key: the spine's call after the CLI's
    assert warm._EARLY[warm_up_key(spec)] is early
    runner = GenerationRunner(spec)
    try:
        assert runner.warm is early and warm_up_key(spec) not in warm._EARLY  # claimed
        assert started.asked == 1 and (early.status, early.reason) == ("skipped", "no CUDA device")
    finally:
        runner.close()
    begin_warm_up(spec, None)  # the CPU asked for: no device started, nothing begun
    assert warm_up_key(spec) not in warm._EARLY


@pytest.mark.parametrize("cuda", [True, False], ids=["a GPU", "no GPU"])
def test_triton_is_imported_and_keyed_while_the_device_starts(tmp_path, monkeypatch, cuda):
    """Triton's import and its cache key (a hash of its files) need no device: the thread
    makes them before it waits for the device's start, where a GPU may be used (device auto
    with an NVIDIA driver installed, asked without starting it); a first kernel's launch then
    finds them made."""
    import types

    from graphrun.generate.runner import begin_warm_up, warm_up_key
    from graphrun.models.causal import warm

    order = []
    cache = types.ModuleType("triton.runtime.cache")
    cache.triton_key = lambda: order.append("triton key")
    for name, module in (("triton", types.ModuleType("triton")),
                         ("triton.runtime", types.ModuleType("triton.runtime")),
                         ("triton.runtime.cache", cache)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr("graphrun.engine.driver.driver_present", lambda: cuda)
    monkeypatch.setattr("graphrun.base.triton_switch._prefetched", [])  # once a process
    # torch's question would start the driver holding the GIL: the order would show it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: order.append("torch asked") or cuda)

    class Starting(Started):
        def wait(self):
            order.append("device started")
            return super().wait()

    spec = builtin_spec(tmp_path, device="auto")
    begin_warm_up(spec, Starting())
    early = warm.claim(warm_up_key(spec))
    early.wait()
    assert order == (["triton key"] if cuda else []) + ["device started"]
    assert (early.status, early.reason) == ("skipped", "no CUDA device")


def test_the_layout_read_from_the_spec(tmp_path):
    import graphrun
    from graphrun.generate.runner import own_shape

    assert own_shape(builtin_spec(tmp_path)) == builtin_shape(**TINY)
    hf = {"hf": {"path": str(FOLDER), "class": "AutoModelForCausalLM"}, "dtype": "float32"}
    shape = own_shape(graphrun.load_spec(write_spec(tmp_path, hf)))
    assert shape is not None and shape.family == "Llama" and shape.d_model == 64
    hf["hf"]["implementation"] = "transformers"
    assert own_shape(graphrun.load_spec(write_spec(tmp_path, hf))) is None


def test_the_kernels_run_on_its_tensors_in_the_interpreter():
    """The warm-up's tensors, laid out as Llama's and GPT-2's, through the real kernels in
    Triton's interpreter (a subprocess: the interpreter is chosen at import)."""
    pytest.importorskip("triton", reason="the paged decode kernel is written in Triton")
    from tests.triton_interpreter import run_interpreted

    p = run_interpreted(
        "import torch; from graphrun.models.causal.warm import Layout, warm_kernels; "
        "cpu = torch.device('cpu'); "
        "print(warm_kernels(Layout(4, 2, 16, 64, 'llama', 48), cpu, torch.float32, 4)); "
        "print(warm_kernels(Layout(4, 2, 16, 64, 'llama', 48), cpu, torch.float16, 4)); "
        "print(warm_kernels(Layout(4, 4, 16, 64, 'gpt2'), cpu, torch.float16, 16))", "[]")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert p.stdout.splitlines()[:3] == [
        "['matmul', 'prefill attention', 'fused elementwise', 'paged decode']",
        "['matmul', 'prefill attention', 'fused elementwise', 'paged decode']",
        "['matmul', 'prefill attention', 'paged decode']"]


# ---- on a GPU -------------------------------------------------------------------------------

# a layout no other test compiles the kernels for: the warm-up's compilations are its own
ODD = dict(layers=2, d_model=192, heads=6, kv_heads=2, vocab=128, max_len=64)
ODD_BLOCK = 8


def kernel_keys() -> set:
    """The specializations the paged and fused kernels hold compiled for the current device."""
    from graphrun.models.causal import fused_kernels, paged_kernels

    device = torch.cuda.current_device()
    return {(name, key) for name, fn in (("split", paged_kernels.split),
                                         ("merge", paged_kernels.merge),
                                         ("norm", fused_kernels.add_rms_norm),
                                         ("rope", fused_kernels.rope),
                                         ("silu", fused_kernels.silu_mul))
            for key in fn.device_caches[device][0]}


def odd_engine(warm, backend="cuda-graph"):
    model = build_llama(**ODD, device="cuda", dtype=torch.bfloat16)
    return build_engine(model, GenerateConfig(max_new_tokens=12), slots=4, max_prompt=16,
                        rows=[1, 2, 4], device="cuda", dtype=torch.bfloat16, backend=backend,
                        block_size=ODD_BLOCK, warm=warm)


@pytest.mark.cuda
def test_the_warm_up_compiles_what_the_engine_launches():
    pytest.importorskip("triton")
    before = kernel_keys()
    warm = WarmUp.begin(layout_of(builtin_shape(**ODD)), torch.device("cuda"), torch.bfloat16,
                        ODD_BLOCK)
    warm.wait()
    assert warm.status == "done", warm.reason
    from graphrun.models.causal import packed_attention

    prefill = ("prefill attention (flash)" if packed_attention.runs_on(
        torch.device("cuda"), torch.bfloat16, ODD["d_model"] // ODD["heads"])
        else "prefill attention")
    assert warm.kernels == ["matmul", prefill, "fused elementwise", "paged decode"]
    warmed = kernel_keys()
    assert warmed - before, "the warm-up compiled nothing new"
    assert {"split", "merge", "norm", "silu"} <= {name for name, _ in warmed - before}
    eng = odd_engine(warm)
    try:
        eng.generate(PROMPTS)
        assert all(g["status"] == "captured" for g in eng.graphs())
        assert kernel_keys() == warmed  # every launch of the engine's was a cache hit
    finally:
        eng.close()


@pytest.mark.cuda
def test_a_jobs_tokens_are_the_same_with_and_without_the_warm_up():
    pytest.importorskip("triton")
    warm = WarmUp.begin(layout_of(builtin_shape(**ODD)), torch.device("cuda"), torch.bfloat16,
                        ODD_BLOCK)
    got = {}
    for name, w in (("warm", warm), ("none", None)):
        eng = odd_engine(w)
        try:
            got[name] = [c.token_ids for c in eng.generate(PROMPTS)]
        finally:
            eng.close()
    assert warm.status == "done", warm.reason
    assert got["warm"] == got["none"]


@pytest.mark.cuda
def test_a_cuda_job_reports_a_done_warm_up(tmp_path):
    pytest.importorskip("tokenizers")
    import graphrun

    from graphrun.generate.runner import warm_up_key
    from graphrun.models.causal import warm as warm_module

    spec = builtin_spec(tmp_path, device="cuda", dtype="bfloat16")
    manifest = graphrun.run(spec)
    warm = manifest.generation.warm_up
    assert warm.status == "done" and warm.run_s > 0 and warm.wait_s <= warm.run_s + 0.1
    assert "paged decode" in warm.kernels
    assert warm_up_key(spec) not in warm_module._EARLY  # run()'s, begun at its setup, claimed


# ---- specs ----------------------------------------------------------------------------------

def write_spec(folder: Path, model: dict, device: str = "cpu") -> Path:
    import yaml

    data = folder / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": i, "prompt": "the river city " * (1 + i)}) + "\n"
                            for i in range(4)))
    spec = {"version": 1, "name": "warm", "device": device, "model": model,
            "data": {"path": str(data), "id_field": "id",
                     "text": {"field": "prompt", "tokenizer": str(FOLDER)}, "batch_size": 4},
            "generate": {"max_new_tokens": 4, "sampling": {"method": "greedy"}},
            "buckets": {"batch": [1, 4], "seq": [16, 32]},
            "output": {"dir": str(folder / "out"), "format": "jsonl"}}
    path = folder / "gen.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def builtin_spec(folder: Path, device: str = "cpu", dtype: str = "float32"):
    import graphrun

    return graphrun.load_spec(write_spec(folder, {"builtin": "llama", "dtype": dtype,
                                                  "args": TINY}, device))
