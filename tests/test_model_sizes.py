"""A model's size is checked before it is built (models/sizes.py): config.json's layers against
the layers its weights hold, and the parameters' bytes against the memory free on the device;
each refused with what was asked and what there is, before any module or tensor is made."""

from __future__ import annotations

import pytest

import graphrun
from graphrun.base.errors import ModelError
from graphrun.models import sizes
from graphrun.models.sizes import check_layers, saved_layers
from tests.test_generate_native import write_spec
from tests.test_model_folder_safety import tiny_copy


def test_the_saved_layers_are_one_stacks_indices_or_unknown():
    assert saved_layers(["model.embed.weight", "model.layers.1.w", "model.layers.0.w",
                         "model.layers.1.mlp.h.7.w"]) == ("model.layers", [0, 1])
    assert saved_layers(["h.0.attn.w", "h.2.attn.w"]) == ("h", [0, 2])
    assert saved_layers(["encoder.block.0.w", "decoder.block.0.w"]) is None  # two stacks
    assert saved_layers(["embed.weight"]) is None
    check_layers("m", {"n_layer": 3}, ["h.0.w", "h.1.w", "h.2.w"])
    with pytest.raises(ModelError, match=r"n_layer is 3, and the saved weights hold 2 layers "
                                         r"\(h\.0 to h\.2\)"):
        check_layers("m", {"n_layer": 3}, ["h.0.w", "h.2.w"])


@pytest.mark.parametrize("implementation", ["auto", "transformers"])
def test_a_config_of_100000_layers_is_refused_before_any_module_is_built(
        tmp_path, monkeypatch, implementation):
    transformers = pytest.importorskip("transformers")
    import graphrun.models.causal.llama as llama

    def built(*args, **kwargs):
        raise AssertionError("a module was built")

    # patches: guards that no module is built, graphrun's and transformers' loaders
    monkeypatch.setattr(llama, "_build", built)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", built)
    folder = tiny_copy(tmp_path, num_hidden_layers=100000)
    spec = graphrun.load_spec(write_spec(tmp_path, folder, implementation=implementation))
    with pytest.raises(ModelError, match=r"num_hidden_layers is 100000, and the saved weights "
                                         r"hold 2 layers .* nothing was built"):
        graphrun.run(spec)
    assert not list((tmp_path / "out").glob("part-*"))


def test_a_builtin_larger_than_the_free_memory_is_refused_before_allocating(monkeypatch):
    from graphrun.models.builtin.mlp import build_mlp

    # a patch: the free memory is the machine's
    monkeypatch.setattr(sizes, "available_bytes", lambda device: 100 << 20)
    # 4 blocks of 4096 x 4096 floats and the rest: 257.5 MiB asked, 100 MiB free
    with pytest.raises(ModelError, match=r"MLP: its parameters take 257\.5 MiB in float32, "
                                         r"more than the 100\.0 MiB free on cpu; give it "
                                         r"smaller sizes \(model\.args\)"):
        build_mlp(hidden=4096, layers=4)
    assert build_mlp(hidden=64, layers=1).out.weight.shape == (16, 64)  # small ones fit


@pytest.mark.parametrize("implementation", ["auto", "transformers"])
def test_a_folder_larger_than_the_free_memory_is_refused_before_loading(
        tmp_path, monkeypatch, implementation):
    pytest.importorskip("transformers")
    # a patch: the free memory is the machine's
    monkeypatch.setattr(sizes, "available_bytes", lambda device: 1 << 16)
    folder = tiny_copy(tmp_path)
    spec = graphrun.load_spec(write_spec(tmp_path, folder, implementation=implementation))
    with pytest.raises(ModelError, match=r"its parameters take 545\.2 KiB in float32, more "
                                         r"than the 64\.0 KiB free on cpu; give a smaller "
                                         r"model\.dtype"):
        graphrun.run(spec)


def test_a_bert_folder_larger_than_the_free_memory_is_refused_before_loading(tmp_path,
                                                                             monkeypatch):
    import torch

    from graphrun.models.bert import find_bert, load_bert
    from tests.test_model_folder_safety import bert_folder

    found = find_bert(bert_folder(tmp_path, pooler=True), "AutoModel", {})
    assert load_bert(found, torch.float32) is not None  # it fits as the machine is
    # a patch: the free memory is the machine's
    monkeypatch.setattr(sizes, "available_bytes", lambda device: 1 << 10)
    with pytest.raises(ModelError, match=r"bert'?: its parameters take \d+\.\d KiB in float32, "
                                         r"more than the 1\.0 KiB free on cpu"):
        load_bert(found, torch.float32)
