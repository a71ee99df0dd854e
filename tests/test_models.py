"""The model step: builtin models, loading every model source and weights, naming outputs."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from graphrun.base.errors import ModelError
from graphrun.models import BUILTINS, build_model, call_model, name_outputs
from graphrun.spec.keys import PipelineSpec

CPU = torch.device("cpu")
ENCODER = Path(__file__).resolve().parents[1] / "examples" / "models" / "tiny_encoder.py"
DECODER_ARGS = {"layers": 2, "d_model": 32, "heads": 4, "vocab": 50, "max_len": 16}


def make_spec(model: dict, batch: list[int] | None = None) -> PipelineSpec:
    return PipelineSpec.model_validate({
        "version": 1,
        "name": "test",
        "model": model,
        "inputs": {"x": {"shape": ["batch", 8]}},
        "outputs": {"y": {"shape": ["batch", 4]}},
        "buckets": {"batch": batch or [1, 2, 4]},
        "data": {"path": "/nonexistent/data.jsonl"},
        "output": {"dir": "/nonexistent/out"},
    })


def decoder(**overrides) -> nn.Module:
    model = {"builtin": "decoder", "args": DECODER_ARGS} | overrides
    return build_model(make_spec(model), CPU)


def decode(model: nn.Module, tokens: list[int], positions: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(tokens=torch.tensor(tokens)[:, None], positions=torch.tensor(positions))


# Builtins.

def test_one_table_lists_every_builtin_with_its_job():
    assert {n: b.job for n, b in BUILTINS.items()} == {"mlp": "forward", "decoder": "forward",
                                                      "llama": "generate"}


def test_a_generating_builtin_is_refused_for_a_forward_pass():
    from graphrun.models.load import _build_builtin

    with pytest.raises(ModelError, match="unknown builtin 'llama' for one forward pass.*mlp, "
                                         "decoder"):
        _build_builtin("llama", {}, 1, torch.device("cpu"), torch.float32)


def test_mlp_shapes_seeded_and_global_rng_untouched():
    spec = make_spec({"builtin": "mlp", "args": {"in_features": 8, "hidden": 16, "layers": 2,
                                                 "out_features": 4}})
    rng = torch.get_rng_state()
    a, b = build_model(spec, CPU), build_model(spec, CPU)
    assert torch.equal(torch.get_rng_state(), rng)
    x = torch.randn(3, 8)
    y = call_model(a, {"x": x}, "keyword")
    assert y.shape == (3, 4)
    assert torch.equal(y, b(x))
    other = build_model(make_spec({"builtin": "mlp", "args": {
        "in_features": 8, "hidden": 16, "layers": 2, "out_features": 4, "seed": 1}}), CPU)
    assert not torch.allclose(y, other(x))


def test_model_is_prepared_on_device_in_dtype_eval_without_grad():
    model = decoder(dtype="bfloat16")
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.blocks[0].attn.cache_k.dtype == torch.bfloat16
    assert model.key_pos.dtype == torch.int64  # integer buffers keep their dtype
    logits = decode(model, [1, 2, 3], [0, 5, 15])
    assert logits.shape == (3, 1, 50) and logits.dtype == torch.bfloat16


def test_decoder_cache_is_sized_by_largest_batch_bucket():
    model = build_model(make_spec({"builtin": "decoder", "args": DECODER_ARGS}, [1, 8, 3]), CPU)
    assert model.blocks[0].attn.cache_k.shape == (8, 4, 16, 8)
    assert "blocks.0.attn.cache_k" not in model.state_dict()  # scratch, not weights
    with pytest.raises(ValueError, match="exceeds its KV cache"):
        decode(model, [1] * 9, [0] * 9)


def test_decoder_batch_rows_equal_rows_run_alone():
    model = decoder()
    tokens, positions = [3, 7, 7, 49], [0, 4, 15, 9]
    batch = decode(model, tokens, positions)
    for row, (t, p) in enumerate(zip(tokens, positions)):
        torch.testing.assert_close(batch[row], decode(model, [t], [p])[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(batch[1], batch[2])  # same token, other position, other logits


def test_decoder_result_does_not_depend_on_earlier_batches_or_row():
    model = decoder()
    first = decode(model, [5, 6], [3, 8])
    decode(model, [11, 12, 13, 14], [3, 8, 2, 0])  # overwrites cache rows 0..3
    torch.testing.assert_close(decode(model, [5, 6], [3, 8]), first, rtol=0, atol=0)
    moved = decode(model, [9, 6, 5], [1, 8, 3])  # the same records in other rows
    torch.testing.assert_close(moved[2], first[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moved[1], first[1], rtol=1e-5, atol=1e-5)


def test_decoder_padded_rows_do_not_change_real_rows_nor_touch_spare_cache():
    model = decoder()
    real = decode(model, [4, 8], [2, 10])
    padded_zero = decode(model, [4, 8, 0, 0], [2, 10, 0, 0])
    padded_other = decode(model, [4, 8, 49, 17], [2, 10, 15, 7])
    torch.testing.assert_close(padded_zero[:2], real, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded_other[:2], padded_zero[:2], rtol=1e-5, atol=1e-5)
    fresh = decoder()
    attn = fresh.blocks[0].attn
    attn.cache_k[2:] = float("nan")  # rows beyond the batch must be neither read nor written
    torch.testing.assert_close(decode(fresh, [4, 8], [2, 10]), real, rtol=1e-5, atol=1e-5)
    assert attn.cache_k[2:].isnan().all()
    # [B, heads, max_len, head_dim]: after the step every row holds the context again
    assert torch.equal(attn.cache_k[:2], attn.ctx_k.expand(2, -1, -1, -1))


def test_unknown_builtin_arg_names_builtin_arg_and_accepted():
    with pytest.raises(ModelError) as err:
        decoder(args={"dmodel": 32})
    msg = str(err.value)
    assert "builtin 'decoder'" in msg and "'dmodel'" in msg
    assert msg.endswith("it accepts: layers, d_model, heads, vocab, max_len, max_batch, seed")


def test_bad_builtin_arg_value_and_unknown_builtin():
    with pytest.raises(ModelError, match=r"d_model \(32\) must be divisible by heads \(5\)"):
        decoder(args=DECODER_ARGS | {"heads": 5})
    with pytest.raises(ModelError, match="unknown builtin 'gpt' for one forward pass per record; "
                                         "choose one of: mlp, decoder"):
        build_model(make_spec({"builtin": "gpt"}), CPU)


# Targets.

NET_SOURCE = """
import torch

def build(width=3, max_batch=None):
    torch.manual_seed(0)
    net = torch.nn.Linear(width, 2)
    net.max_batch = max_batch
    return net

def not_a_module():
    return 42

def broken():
    raise RuntimeError("out of widgets")
"""


def test_target_by_module_name_imports_beside_spec_only_during_import(tmp_path):
    (tmp_path / "gr_test_net_a.py").write_text(NET_SOURCE)
    path_before = list(sys.path)
    spec = make_spec({"target": "gr_test_net_a:build", "args": {"width": 5}}, [2, 16])
    model = build_model(spec, CPU, base_dir=tmp_path)
    assert sys.path == path_before
    assert isinstance(model, nn.Linear) and model.in_features == 5
    assert model.max_batch == 16  # the largest batch bucket, for builders that take it


def test_target_by_relative_py_path(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "net.py").write_text(NET_SOURCE)
    spec = make_spec({"target": "models/net.py:build", "args": {"max_batch": 3}})
    model = build_model(spec, CPU, base_dir=tmp_path)
    assert model.in_features == 3 and model.max_batch == 3  # given args win


def test_a_target_import_refreshes_its_own_folders_finder_only(tmp_path, monkeypatch):
    """The folder's files may be newer than its finder's cache, so that finder is refreshed;
    the others are not walked (another thread's import could change sys.path_importer_cache
    during that walk: "dictionary changed size during iteration")."""
    import importlib.machinery as machinery

    (tmp_path / "net.py").write_text(NET_SOURCE)
    calls = []
    own = machinery.FileFinder(str(tmp_path), (machinery.SourceFileLoader, [".py"]))
    monkeypatch.setattr(own, "invalidate_caches", lambda: calls.append("own"))

    class Other:
        def invalidate_caches(self):
            calls.append("other")

    monkeypatch.setitem(sys.path_importer_cache, str(tmp_path), own)
    monkeypatch.setitem(sys.path_importer_cache, str(tmp_path / "elsewhere"), Other())
    build_model(make_spec({"target": "net.py:build"}), CPU, base_dir=tmp_path)
    assert calls == ["own"]


@pytest.mark.parametrize("target, message", [
    ("gr_test_no_such_module:build", "cannot import 'gr_test_no_such_module'"),
    ("net.py:builder", "net.py has no attribute 'builder'; did you mean 'build'? Callables it "
     "defines: broken, build"),
    ("net.py:not_a_module", "returned a int, not a torch.nn.Module"),
    ("net.py:broken", "RuntimeError: out of widgets"),
    ("missing.py:build", "file not found"),
    ("net.py", "expected 'package.module:callable'"),
])
def test_target_errors_say_what_and_where(tmp_path, target, message):
    (tmp_path / "net.py").write_text(NET_SOURCE)
    with pytest.raises(ModelError, match="model.target") as err:
        build_model(make_spec({"target": target}), CPU, base_dir=tmp_path)
    assert message in str(err.value)
    assert "graphrun_target_" not in str(err.value)  # the user's file, not the import's name


def test_target_unknown_arg_lists_accepted(tmp_path):
    (tmp_path / "net.py").write_text(NET_SOURCE)
    with pytest.raises(ModelError, match="unknown argument 'depth'; it accepts: width, max_batch"):
        build_model(make_spec({"target": "net.py:build", "args": {"depth": 2}}), CPU,
                    base_dir=tmp_path)


# The example encoder, through a target path.

def encoder() -> nn.Module:
    spec = make_spec({"target": f"{ENCODER}:build",
                      "args": {"vocab": 30, "d_model": 32, "max_len": 12}})
    return build_model(spec, CPU)


def test_encoder_padding_does_not_change_real_positions():
    model = encoder()
    record = torch.tensor([[5, 9, 2, 17]])  # [1, 4]
    with torch.inference_mode():
        alone = model(tokens=record, mask=torch.ones(1, 4, dtype=torch.bool))
        tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 7],
                               [5, 9, 2, 17, 0, 0, 0],
                               [0, 0, 0, 0, 0, 0, 0]])  # other record, ours, a padded row
        mask = torch.tensor([[1] * 7, [1, 1, 1, 1, 0, 0, 0], [0] * 7])
        batch = model(tokens=tokens, mask=mask)
    assert batch["hidden"].shape == (3, 7, 32) and batch["pooled"].shape == (3, 32)
    torch.testing.assert_close(batch["hidden"][1, :4], alone["hidden"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch["pooled"][1], alone["pooled"][0], rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(batch["hidden"][1, 4:]) == 0
    assert torch.isfinite(batch["pooled"]).all()  # the all-padding row included


# Exported and TorchScript archives.

class Affine(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("shift", torch.arange(4))  # integer buffer

    def forward(self, x):
        return self.lin(x) + self.shift


def test_exported_round_trip(tmp_path):
    source, x = Affine().eval(), torch.randn(2, 8)
    program = torch.export.export(source, (x,))
    torch.export.save(program, tmp_path / "m.pt2")
    model = build_model(make_spec({"exported": str(tmp_path / "m.pt2"), "call": "positional"}),
                        CPU)
    torch.testing.assert_close(call_model(model, {"x": x}, "positional"), source(x))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torchscript_round_trip(tmp_path):
    source, x = Affine().eval(), torch.randn(3, 8)
    torch.jit.save(torch.jit.script(source), tmp_path / "m.ts")
    model = build_model(make_spec({"torchscript": str(tmp_path / "m.ts")}), CPU)
    torch.testing.assert_close(model(x), source(x))
    assert not model.training


@pytest.mark.parametrize("key", ["exported", "torchscript"])
def test_archive_errors(tmp_path, key):
    with pytest.raises(ModelError, match=f"model.{key}: file not found"):
        build_model(make_spec({key: str(tmp_path / "absent")}), CPU)
    (tmp_path / "junk").write_bytes(b"not an archive")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ModelError, match=f"model.{key} .*junk: not a loadable"):
            build_model(make_spec({key: str(tmp_path / "junk")}), CPU)


# Weights.

MLP_ARGS = {"in_features": 8, "hidden": 16, "layers": 2, "out_features": 4}


def mlp_spec(weights: Path | None = None, **args) -> PipelineSpec:
    return make_spec({"builtin": "mlp", "args": MLP_ARGS | args, "weights": weights})


def test_weights_pt_round_trip(tmp_path):
    trained = build_model(mlp_spec(seed=7), CPU)
    torch.save(trained.state_dict(), tmp_path / "w.pt")
    model = build_model(mlp_spec(tmp_path / "w.pt"), CPU)  # seed 0, then the seed-7 weights
    x = torch.randn(2, 8)
    torch.testing.assert_close(model(x), trained(x), rtol=0, atol=0)


def test_weights_decoder_round_trip_keeps_context(tmp_path):
    trained = decoder(args=DECODER_ARGS | {"seed": 3})
    torch.save(trained.state_dict(), tmp_path / "w.pt")
    model = decoder(weights=str(tmp_path / "w.pt"))
    torch.testing.assert_close(decode(model, [1, 2], [3, 4]), decode(trained, [1, 2], [3, 4]))


def test_weights_key_mismatch_lists_keys(tmp_path):
    torch.save(build_model(mlp_spec(layers=3), CPU).state_dict(), tmp_path / "w.pt")
    with pytest.raises(ModelError) as err:
        build_model(mlp_spec(tmp_path / "w.pt", layers=1), CPU)
    msg = str(err.value)
    assert "model.weights" in msg and "the saved weights are not the model's" in msg
    assert "8 unexpected (blocks.1.fc.bias; blocks.1.fc.weight; blocks.1.norm.bias" in msg
    assert "missing" not in msg


def test_weights_shape_mismatch_and_not_a_state_dict(tmp_path):
    torch.save(build_model(mlp_spec(hidden=32), CPU).state_dict(), tmp_path / "wide.pt")
    with pytest.raises(ModelError, match=r"model.weights .*: the saved weights are not the "
                       r"model's: 13 of another shape \(blocks.0.fc.bias: saved \[32\], model "
                       r"\[16\]; .* and 9 more\)"):
        build_model(mlp_spec(tmp_path / "wide.pt"), CPU)
    torch.save({"epoch": 3, "model": {}}, tmp_path / "ckpt.pt")
    with pytest.raises(ModelError, match=r"entries \['epoch', 'model'\] are not tensors"):
        build_model(mlp_spec(tmp_path / "ckpt.pt"), CPU)
    with pytest.raises(ModelError, match="model.weights: file not found"):
        build_model(mlp_spec(tmp_path / "absent.pt"), CPU)


def test_safetensors_without_package_says_how_to_fix(tmp_path, monkeypatch):
    (tmp_path / "w.safetensors").write_bytes(b"\0" * 16)
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import now raises ImportError
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ModelError, match="`pip install safetensors`, or convert"):
        build_model(mlp_spec(tmp_path / "w.safetensors"), CPU)


def test_safetensors_round_trip(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    trained = build_model(mlp_spec(seed=7), CPU)
    st.save_file(trained.state_dict(), str(tmp_path / "w.safetensors"))
    model = build_model(mlp_spec(tmp_path / "w.safetensors"), CPU)
    x = torch.randn(2, 8)
    torch.testing.assert_close(model(x), trained(x), rtol=0, atol=0)


# Calling and naming outputs.

def test_call_model_keyword_and_positional():
    def f(a, b):
        return a - b
    a, b = torch.tensor([5.0]), torch.tensor([2.0])
    assert call_model(f, {"b": b, "a": a}, "keyword").item() == 3.0
    assert call_model(f, {"b": b, "a": a}, "positional").item() == -3.0


def test_name_outputs_tensor_tuple_dict():
    a, b = torch.zeros(2), torch.ones(2)
    assert name_outputs(a, ["y"])["y"] is a
    assert name_outputs((a, b), ["y", "z"]) == {"y": a, "z": b}
    assert name_outputs([a], ["y"]) == {"y": a}
    named = name_outputs({"z": b, "y": a, "extra": a}, ["y", "z"])
    assert list(named) == ["y", "z"] and named["z"] is b


@pytest.mark.parametrize("ret, names, message", [
    (torch.zeros(2, 3), ["y", "z"], "returned a tensor [2, 3] float32, but the spec's outputs "
     "expect 2 named ['y', 'z']; return a tuple of 2 tensors"),
    ((torch.zeros(1),) * 3, ["y", "z"], "returned a tuple of 3 (a tensor [1] float32,"),
    ({"hidden": torch.zeros(1)}, ["pooled"], "a dict with keys ['hidden'], but the spec's "
     "outputs expect 1 named ['pooled']; the model returns no ['pooled']"),
    ((torch.zeros(1), 3), ["y", "z"], "outputs ['z'] are not tensors"),
    (None, ["y"], "returned a NoneType"),
])
def test_name_outputs_errors(ret, names, message):
    with pytest.raises(ModelError) as err:
        name_outputs(ret, names)
    assert message in str(err.value)


# A builder as users write them for benchmarks and tests: seeded, randomly initialised.
SEEDED_SOURCE = """
import torch


class Scorer(torch.nn.Module):
    def __init__(self, width, max_batch):
        super().__init__()
        self.first, self.second = torch.nn.Linear(width, 16), torch.nn.Linear(16, 4)
        self.scratch = torch.zeros(max_batch, 16)
        self.built_on = torch.empty(0).device.type  # where the builder's tensors were made

    def forward(self, x):
        return self.second(torch.nn.functional.gelu(self.first(x)))


def build(width=8, max_batch=1):
    torch.manual_seed(0)
    return Scorer(width, max_batch)
"""


def users_own(folder: Path, name: str = "seeded") -> object:
    """The builder's module as the user's own code imports it."""
    import importlib.util

    path = folder / f"{name}.py"
    path.write_text(SEEDED_SOURCE)
    module_spec = importlib.util.spec_from_file_location(f"users_{name}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_a_seeded_target_is_built_as_its_users_code_builds_it_on_the_cpu(tmp_path):
    """Whatever the run's device, a target without weights is built on the CPU and moved:
    its random init draws from the CPU generator, as in its user's own process."""
    users_own(tmp_path)
    spec = make_spec({"target": "seeded.py:build"})
    assert build_model(spec, torch.device("meta"), base_dir=tmp_path).built_on == "cpu"


def test_a_seeded_targets_values_and_outputs_are_its_users_own(tmp_path):
    own = users_own(tmp_path).build(max_batch=4)
    model = build_model(make_spec({"target": "seeded.py:build"}), CPU, base_dir=tmp_path)
    got, want = model.state_dict(), own.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(model(x=x), own(x))


def test_a_timm_model_without_timm_names_the_extra(monkeypatch):
    from graphrun.models.vision import load_timm
    from graphrun.spec.keys import TimmModelSpec

    monkeypatch.setitem(sys.modules, "timm", None)  # import fails as if absent
    with pytest.raises(ModelError, match=r'pip install -e "\.\[vision\]" in the graphrun clone'):
        load_timm(TimmModelSpec(name="resnet18"))
