"""A model folder graphrun is given is checked before any work: no Python shipped in it runs
unless the spec allows it (nothing is asked on stdin), and its weights are the model's its
config.json describes: none missing, none left over, each of the model's shape and dtype, on
every path (graphrun's own code, transformers' class, model.weights)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers")

from tests.children import child_env  # noqa: E402
from tests.test_generate_native import write_spec  # noqa: E402

EVIL_CONFIG = """import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import PretrainedConfig


class EvilConfig(PretrainedConfig):
    model_type = "evil"
"""


def cli(*args, stdin: str = "", cwd=None):
    return subprocess.run([sys.executable, "-m", "graphrun", *map(str, args)], input=stdin,
                          cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=300)


def evil_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A folder whose config.json maps AutoConfig to its own configuration_evil.py, which
    writes a marker file when imported."""
    folder, marker = tmp_path / "evil", tmp_path / "MARKER"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "evil", "architectures": ["EvilModel"],
        "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                     "AutoModel": "modeling_evil.EvilModel"}}))
    (folder / "configuration_evil.py").write_text(EVIL_CONFIG.format(marker=str(marker)))
    (folder / "modeling_evil.py").write_text(EVIL_CONFIG.format(marker=str(marker)))
    (folder / "tokenizer.json").write_text("{}")
    return folder, marker


def test_a_folders_own_python_never_runs_without_trust_remote_code_whatever_stdin_says(
        tmp_path):
    folder, marker = evil_folder(tmp_path)
    (tmp_path / "texts.jsonl").write_text('{"id": 1, "text": "hello"}\n')
    spec = {"version": 1, "name": "evil", "device": "cpu",
            "model": {"hf": {"path": str(folder), "class": "AutoModel"}},
            "inputs": {"input_ids": {"shape": ["batch", "seq"], "dtype": "int64"}},
            "outputs": {"last_hidden_state": {"shape": ["batch", "seq", 4]}},
            "buckets": {"batch": [1], "seq": [8]},
            "data": {"path": str(tmp_path / "texts.jsonl"), "text": {"field": "text"}},
            "output": {"dir": str(tmp_path / "out"), "format": "jsonl"}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    for proc in (cli("run", tmp_path / "s.yaml", stdin="y\n" * 20),
                 cli("init", "--hf", folder, "--data", tmp_path / "texts.jsonl", "-o",
                     tmp_path / "init.yaml", stdin="y\n" * 20)):
        assert proc.returncode != 0, proc.stdout
        assert "Traceback" not in proc.stderr, proc.stderr
        assert "configuration_evil.py" in proc.stderr and "trust_remote_code" in proc.stderr
        assert "[y/N]" not in proc.stdout + proc.stderr
        assert not marker.exists()


def test_a_known_model_type_with_an_auto_map_loads_with_transformers_own_class(tmp_path):
    from graphrun.models.hf import refuse_remote_code

    folder, marker = evil_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    refuse_remote_code(str(folder), "model.hf", "allow it")  # bert's class is transformers'
    assert not marker.exists()


# ---- weights that are not the model's config.json describes ------------------------------------

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "models" / "tiny-llama"  # 2 layers, float32, its tokenizer beside


def tiny_copy(tmp_path: Path, **config) -> Path:
    """The tiny Llama's folder with config.json changed as given."""
    folder = tmp_path / "m"
    shutil.copytree(TINY, folder)
    edited = {**json.loads((TINY / "config.json").read_text()), **config}
    (folder / "config.json").write_text(json.dumps(edited))
    return folder


def refused(spec: Path, pattern: str) -> str:
    """graphrun.run of the spec is one ModelError matching pattern, before any output."""
    import graphrun
    from graphrun.base.errors import ModelError

    with pytest.raises(ModelError, match=pattern) as err:
        graphrun.run(graphrun.load_spec(spec))
    out = spec.parent / "out"
    assert not list(out.glob("part-*"))
    return str(err.value)


def relabel(path: Path, name: str, old: str, new: str) -> None:
    """Rewrite one tensor's dtype in a safetensors header (same width: the file stays valid)."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    at = raw.index(json.dumps(name).encode(), 8, 8 + size)
    at = raw.index(f'"{old}"'.encode(), at, 8 + size)
    path.write_bytes(raw[:at] + f'"{new}"'.encode() + raw[at + len(old) + 2:])


HOLD_TWO = (r"config.json's num_hidden_layers is {}, and the saved weights hold 2 layers "
            r"\(model\.layers\.0 to model\.layers\.1\)")
LAYERS = [(3, HOLD_TWO.format(3), HOLD_TWO.format(3)),
          (1, HOLD_TWO.format(1), HOLD_TWO.format(1)),
          (-5, r"config.json: num_hidden_layers is -5, not a whole number",
           r"unexpected \(model\.layers\.0\."),
          (2.7, r"config.json: num_hidden_layers is 2.7, not a whole number",
           r"field 'num_hidden_layers'")]


@pytest.mark.parametrize("layers,ours,theirs", LAYERS, ids=[str(x[0]) for x in LAYERS])
def test_a_config_whose_layers_the_weights_lack_or_exceed_never_runs(tmp_path, layers, ours,
                                                                     theirs):
    folder = tiny_copy(tmp_path, num_hidden_layers=layers)
    refused(write_spec(tmp_path, folder), ours)  # implementation: auto
    refused(write_spec(tmp_path, folder, implementation="transformers"), theirs)


@pytest.mark.parametrize("implementation", ["auto", "transformers"])
def test_integers_relabelled_as_floats_in_a_header_are_refused(tmp_path, implementation):
    folder = tiny_copy(tmp_path)
    relabel(folder / "model.safetensors", "model.norm.weight", "F32", "I32")
    refused(write_spec(tmp_path, folder, implementation=implementation),
            r"of another kind of dtype \(model\.norm\.weight: saved I32, model torch\.float32\)")


def test_a_transposed_tensor_or_another_vocabulary_is_one_error_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tiny_copy(tmp_path, vocab_size=10**12)
    refused(write_spec(tmp_path, folder), r"model\.embed_tokens\.weight: saved \[512, 64\], "
                                               r"model \[1000000000000, 64\]")
    folder = tiny_copy(tmp_path / "v", vocab_size=200)
    refused(write_spec(tmp_path / "v", folder, implementation="transformers"),
            r"2 of another shape \(lm_head\.weight: saved \[512, 64\], model \[200, 64\]")
    folder = tiny_copy(tmp_path / "t")
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].T.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    refused(write_spec(tmp_path / "t", folder),
            rf"{name}: saved \[128, 64\], model \[64, 128\]")


@pytest.mark.parametrize("change,pattern", [
    ({"num_attention_heads": 0}, r"num_attention_heads is 0, not a whole number of at least 1"),
    ({"hidden_size": 2**30, "head_dim": None}, r"\[64\], model \[1073741824\]"),
])
def test_an_absurd_size_in_config_json_is_one_message_naming_the_file(tmp_path, change,
                                                                     pattern):
    folder = tiny_copy(tmp_path, **change)
    message = refused(write_spec(tmp_path, folder), pattern)
    assert str(folder) in message and "config.json" in message


def bert_folder(tmp_path: Path, pooler: bool) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32,
                                     max_position_embeddings=32)
    folder = tmp_path / "bert"
    transformers.BertModel(config, add_pooling_layer=pooler).save_pretrained(folder)
    return folder


def encoder_spec(tmp_path: Path, folder: Path, outputs: dict | None = None,
                 **model) -> "PipelineSpec":  # noqa: F821
    from graphrun.spec.load import load_spec

    (tmp_path / "ids.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    spec = {"version": 1, "name": "enc", "device": "cpu",
            "model": {"hf": {"path": str(folder), "implementation": "transformers"}, **model},
            "inputs": {"input_ids": {"shape": ["batch", "seq"], "dtype": "int64"}},
            "outputs": outputs or {"last_hidden_state": {"shape": ["batch", "seq", 16]}},
            "buckets": {"batch": [1], "seq": [4]},
            "data": {"path": str(tmp_path / "ids.jsonl")},
            "output": {"dir": str(tmp_path / "out"), "format": "jsonl"}}
    (tmp_path / "enc.yaml").write_text(yaml.safe_dump(spec))
    return load_spec(tmp_path / "enc.yaml")


def test_a_missing_tensor_runs_only_where_model_allow_missing_names_it(tmp_path):
    import torch

    from graphrun.base.errors import ModelError
    from graphrun.models.load import build_model

    folder = bert_folder(tmp_path, pooler=False)
    pooled = {"pooler_output": {"shape": ["batch", 16]}}  # an output that reads the pooler
    with pytest.raises(ModelError, match=r"2 missing \(pooler\.dense\.bias; pooler\.dense\."
                                         r"weight\).*name it in model\.allow_missing"):
        build_model(encoder_spec(tmp_path, folder, pooled), torch.device("cpu"))
    model = build_model(encoder_spec(tmp_path, folder, pooled, allow_missing=["pooler.*"]),
                        torch.device("cpu"))
    assert model.pooler.dense.weight.shape == (16, 16)


def test_model_weights_are_checked_as_a_folders_are(tmp_path):
    import torch
    from safetensors.torch import save_file

    from graphrun.base.errors import ModelError
    from graphrun.models.builtin.mlp import build_mlp
    from graphrun.models.load import build_model
    from graphrun.spec.keys import PipelineSpec

    ARGS = {"in_features": 4, "hidden": 8, "out_features": 2, "layers": 1, "seed": 3}

    def mlp(weights: Path, **model) -> PipelineSpec:
        return PipelineSpec.model_validate({
            "version": 1, "name": "m", "device": "cpu",
            "model": {"builtin": "mlp", "args": ARGS,
                      "weights": str(weights), **model},
            "inputs": {"x": {"shape": ["batch", 4]}}, "outputs": {"y": {"shape": ["batch", 2]}},
            "buckets": {"batch": [1]}, "data": {"path": "d.jsonl"}, "output": {"dir": "o"}})

    cpu = torch.device("cpu")
    state = build_mlp(**ARGS).state_dict()
    name = sorted(state)[0]
    save_file({**state, name: state[name].to(torch.int32)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(ModelError, match=rf"{name}: saved torch\.int32, model torch\.float32"):
        build_model(mlp(tmp_path / "w.safetensors"), cpu)
    save_file({k: v for k, v in state.items() if k != name}, str(tmp_path / "w.safetensors"))
    with pytest.raises(ModelError, match=rf"1 missing \({name}\)"):
        build_model(mlp(tmp_path / "w.safetensors"), cpu)
    model = build_model(mlp(tmp_path / "w.safetensors", allow_missing=[name]), cpu)
    rest = model.state_dict()
    assert all(torch.equal(rest[k], v) for k, v in state.items() if k != name)


@pytest.mark.parametrize("content,problem", [
    ((TINY / "tokenizer.json").read_bytes()[:500], "EOF while parsing"),
    (b"", "EOF while parsing"),
    (b"[1, 2]", "invalid type: sequence"),
    (b'{"version": "\xff"}', "valid UTF-8"),
], ids=["truncated", "empty", "list", "invalid-utf8"])
def test_a_bad_tokenizer_json_is_one_message_naming_the_file(tmp_path, content, problem):
    folder = tiny_copy(tmp_path)
    (folder / "tokenizer.json").write_bytes(content)
    message = refused(write_spec(tmp_path, folder), problem)
    assert str(folder / "tokenizer.json") in message


def test_a_tokenizer_folder_with_its_own_code_is_refused_unless_allowed(tmp_path):
    from graphrun.base.errors import ModelError
    from graphrun.models.hf import fast_tokenizer

    folder, marker = evil_folder(tmp_path)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}))
    (folder / "tokenization_evil.py").write_text(EVIL_CONFIG.format(marker=str(marker)))
    with pytest.raises(ModelError, match=r"tokenizer_config.json .*tokenization_evil.py.*"
                                         r"model.hf.trust_remote_code: true"):
        fast_tokenizer(str(folder), trust_remote_code=False)
    assert not marker.exists()
