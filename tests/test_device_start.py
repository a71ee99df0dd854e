"""device_start.py: the device resolved (and its CUDA context made) on a thread beside
setup; what fails there is raised where the Runner waits for it."""

import pytest
import torch

from graphrun.engine.device_start import DeviceStart
from graphrun.base.errors import GraphrunError
from graphrun.spec.keys import PipelineSpec

SPEC = {"version": 1, "name": "t", "model": {"builtin": "mlp", "args": {"in_features": 4}},
        "inputs": {"x": {"shape": ["batch", 4], "dtype": "float32"}},
        "outputs": {"scores": {"shape": ["batch", 16]}}, "buckets": {"batch": [1, 2]},
        "data": {"path": "x.npy"}, "output": {"dir": "out"}}


def spec(**top) -> PipelineSpec:
    return PipelineSpec.model_validate({**SPEC, **top})


def test_nothing_to_start_for_the_cpu():
    assert DeviceStart.begin(spec(device="cpu")) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_auto_without_cuda_is_the_cpu():
    assert DeviceStart.begin(spec(device="auto")).wait() == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_a_missing_device_is_raised_on_the_waiting_thread():
    started = DeviceStart.begin(spec(device="cuda:0"))
    with pytest.raises(GraphrunError, match="no CUDA"):
        started.wait()


@pytest.mark.cuda
def test_the_context_exists_after_the_wait():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = DeviceStart.begin(spec(device="auto", model={**SPEC["model"],
                                                          "dtype": "bfloat16"})).wait()
    assert device.type == "cuda" and torch.cuda.is_initialized()


def test_a_spec_is_checked_without_torch(tmp_path):
    """The CLI reads the spec before torch's import (its errors come at once) and starts the
    device beside that import: nothing in the spec's checks may import torch."""
    import subprocess
    import sys

    from tests.children import child_env

    code = ("import sys; from graphrun.spec.load import load_spec; load_spec(sys.argv[1]); "
            "print(sorted({'torch', 'numpy', 'pyarrow'} & set(sys.modules)))")
    for spec in ("decoder-step", "minilm-embed", "mlp-scorer"):
        got = subprocess.run([sys.executable, "-c", code, f"pipelines/{spec}.yaml"],
                             capture_output=True, text=True, env=child_env(), check=True)
        assert got.stdout.strip() == "[]", spec


def test_the_names_the_spec_checks_are_the_builders_and_readers():
    from graphrun.read.formats import SUFFIXES
    from graphrun.models.builtins import BUILTINS
    from graphrun.spec.keys import BUILTIN_JOBS, INPUT_SUFFIXES

    assert {name: b.job for name, b in BUILTINS.items()} == BUILTIN_JOBS
    assert sorted(SUFFIXES) == sorted(INPUT_SUFFIXES)


def test_the_spec_checks_byte_sizes_are_numpys():
    import numpy as np

    from graphrun.spec.keys import DTYPES
    from graphrun.base.dtypes import ITEMSIZE as ITEMSIZES

    assert set(ITEMSIZES) == set(DTYPES)
    assert all(ITEMSIZES[d] == np.dtype(d).itemsize for d in DTYPES if d != "bfloat16")
