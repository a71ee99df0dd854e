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
