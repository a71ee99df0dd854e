"""The switch of a family of Triton kernels (base/triton_switch.py): its module imported on first
use only, on for a GPU or for the CPU under Triton's interpreter, off for good after a failure
(the first one the reason), off where the module cannot import."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from graphrun.base.triton_switch import KernelSwitch
from graphrun.generate import sampling
from graphrun.models.causal import fused, paged_attention

CPU, GPU = torch.device("cpu"), torch.device("cuda")  # a device is read by its type only


@pytest.fixture
def kernels(tmp_path, monkeypatch) -> str:
    """The name of a kernels' module that imports (no Triton in it)."""
    name = f"switch_kernels_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text("KERNEL = 'a kernel'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return name


def test_the_module_is_imported_on_first_use_only(kernels, monkeypatch):
    switch = KernelSwitch(kernels)
    assert not switch.on(CPU)  # the CPU outside the interpreter: no need to import
    assert kernels not in sys.modules
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert switch.on(CPU)
    assert switch.kernels is sys.modules[kernels] and switch.kernels.KERNEL == "a kernel"


def test_on_for_a_gpu_and_for_the_cpu_under_the_interpreter_only(kernels, monkeypatch):
    switch = KernelSwitch(kernels)
    assert switch.on(GPU) and not switch.on(CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not switch.on(CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert switch.on(CPU) and switch.on(GPU)
    assert not switch.on(torch.device("meta"))


def test_a_failure_turns_it_off_and_the_first_is_the_reason(kernels):
    switch = KernelSwitch(kernels)
    assert switch.failure() is None and switch.on(GPU)
    switch.give_up(RuntimeError("no kernel image for this GPU\nsecond line"))
    switch.give_up(ValueError("a later one"))
    assert not switch.on(GPU)
    assert switch.failure() == "RuntimeError: no kernel image for this GPU"
    assert switch.failures == ["RuntimeError: no kernel image for this GPU",
                               "ValueError: a later one"]


def test_a_module_that_cannot_import_gives_none_and_off(tmp_path, monkeypatch):
    # as without Triton: the kernels' module is there, what it imports is not
    (tmp_path / "switch_needs_triton.py").write_text("import switch_no_such_triton\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name in ("switch_needs_triton", "switch_no_such_module"):
        switch = KernelSwitch(name)
        assert not switch.on(GPU) and not switch.on(CPU)
        assert switch.kernels is None and switch.failure() is None


def test_each_family_names_a_kernels_module_that_exists():
    # the switch imports by name, where the layering and dead-code tests cannot see a typo
    for switch in (paged_attention.SWITCH, fused.SWITCH, sampling.SWITCH):
        assert importlib.util.find_spec(switch.module) is not None, switch.module
    assert len({paged_attention.SWITCH.module, fused.SWITCH.module, sampling.SWITCH.module}) == 3


def test_prefetch_runs_once_and_a_call_during_it_waits_for_its_result(monkeypatch):
    import threading
    import time

    from graphrun.base import triton_switch

    calls, started = [], threading.Event()

    def slow() -> bool:
        started.set()
        time.sleep(0.2)
        calls.append(1)
        return True

    monkeypatch.setattr(triton_switch, "_prefetched", [])
    monkeypatch.setattr(triton_switch, "_prefetch", slow)
    triton_switch.prefetch_beside()
    assert started.wait(5)
    assert triton_switch.prefetch() is True and calls == [1]  # waited: not a second hash
    assert triton_switch.prefetch() is True and calls == [1]


# a generation spec's imports, the driver taken as present: where the prefetch begins
BEGINS = """
import json, sys
from pathlib import Path
import graphrun.base.triton_switch as ts
import graphrun.engine.driver as driver
seen = []
ts.prefetch_beside = lambda: seen.append("torch" in sys.modules)
driver.driver_present = lambda: True
from graphrun.base.phases import PhaseClock
from graphrun.cli.main import import_engine
from graphrun.spec.load import load_spec
import_engine(load_spec(Path(sys.argv[1]), sys.argv[2:]), PhaseClock(), alone=True)
print("SEEN", json.dumps(seen))
"""


@pytest.mark.parametrize("device, begun", [("auto", [False]), ("cpu", [])])
def test_the_cli_begins_triton_s_prefetch_before_torch_s_import(tmp_path, device, begun):
    import json
    import subprocess
    from pathlib import Path

    import yaml

    from tests.children import child_env

    root = Path(__file__).resolve().parents[1]
    spec = {"version": 1, "name": "gen", "device": device,
            "model": {"hf": {"path": str(root / "examples/models/tiny-llama"),
                             "class": "AutoModelForCausalLM"}, "dtype": "float32"},
            "data": {"path": str(root / "examples/data/prompts.jsonl"), "id_field": "id",
                     "text": {"field": "prompt"}},
            "generate": {"max_new_tokens": 2}, "output": {"dir": str(tmp_path / "out")}}
    path = tmp_path / "gen.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**child_env(), "GRAPHRUN_KERNEL_WARM_UP": "on"}
    done = subprocess.run([sys.executable, "-c", BEGINS, str(path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [ln for ln in done.stdout.splitlines() if ln.startswith("SEEN ")]
    assert json.loads(said[-1].removeprefix("SEEN ")) == begun  # [False]: torch not yet in
