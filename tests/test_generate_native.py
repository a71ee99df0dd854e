"""graphrun's own Llama loading Hugging Face folders (model.hf.implementation auto/graphrun):
greedy completions equal transformers' generate record by record for each family and RoPE
kind it takes, a folder it cannot load as transformers would falls back with the reason in the
manifest, and a job on such a folder never imports transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers")

import graphrun  # noqa: E402
from graphrun.base.errors import ModelError  # noqa: E402
from graphrun.generate import GenerateConfig, build_engine  # noqa: E402
from graphrun.models.causal.llama import Checkpoint, find_checkpoint, load_checkpoint  # noqa: E402
from tests.children import imports_transformers  # noqa: E402
from tests.generate_models import IDS, PROMPTS, _spread, hf_greedy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
KINDS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "llama-tied-bias": ("LlamaForCausalLM", "LlamaConfig",
                        {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    "llama3-rope": ("LlamaForCausalLM", "LlamaConfig", {"rope_parameters": LLAMA3}),
    "linear-rope": ("LlamaForCausalLM", "LlamaConfig",
                    {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0,
                                         "factor": 4.0}}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"head_dim": 32}),
    # a window shorter than the records: their completions depend on it
    "mistral-window": ("MistralForCausalLM", "MistralConfig", {"sliding_window": 4}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 24, "attention_bias": True}),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {}),  # its config maps the Llama names
}


def save(folder: Path, kind: str = "llama", **extra) -> Path:
    import transformers

    cls, config_cls, changes = KINDS[kind]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**BASE, **changes, **extra})
    model = _spread(getattr(transformers, cls)(config).eval())
    if config.tie_word_embeddings:  # _spread scaled the shared matrix once: still tied
        assert (model.get_output_embeddings().weight.data_ptr()
                == model.get_input_embeddings().weight.data_ptr())
    with torch.no_grad():  # biases off zero and norms off one, so one loaded wrongly shows
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif name.endswith("norm.weight"):
                p.mul_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def generate(model, **config):
    gen = build_engine(model, GenerateConfig(**config), slots=8, max_prompt=16)
    try:
        return [c.token_ids for c in gen.generate(PROMPTS, IDS)]
    finally:
        gen.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_greedy_on_graphruns_llama_equals_transformers_generate(tmp_path, kind):
    import transformers

    folder = save(tmp_path / kind, kind)
    found = find_checkpoint(folder, "AutoModelForCausalLM", {})
    assert isinstance(found, Checkpoint), found
    ours = load_checkpoint(found, torch.device("cpu"), torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert generate(ours, max_new_tokens=10) == hf_greedy(theirs, PROMPTS, max_new_tokens=10)
    assert found.eos_ids == (2,) and found.pad_id == 0


def test_a_gpt2_checkpoint_saved_as_openai_did_loads(tmp_path):
    """openai-community/gpt2's safetensors name its tensors without `transformer.` and hold
    the causal-mask buffers older transformers saved: both as transformers loads them."""
    import transformers
    from safetensors.torch import load_file, save_file

    folder = save(tmp_path / "gpt2", "gpt2")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {n.removeprefix("transformer."): t for n, t in tensors.items()}
    renamed["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128, dtype=torch.bool))
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    found = find_checkpoint(folder, "GPT2LMHeadModel", {})
    assert isinstance(found, Checkpoint), found
    ours = load_checkpoint(found, torch.device("cpu"), torch.float32)
    assert generate(ours, max_new_tokens=8) == hf_greedy(theirs, PROMPTS, max_new_tokens=8)


def test_stopping_at_the_folders_eos_equals_transformers(tmp_path):
    import transformers

    folder = save(tmp_path / "m")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    free = hf_greedy(theirs, PROMPTS, max_new_tokens=12)
    eos = next(row[3] for row in free if row[3] not in row[:3])
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    (folder / "generation_config.json").unlink(missing_ok=True)
    found = find_checkpoint(folder, "LlamaForCausalLM", {})
    assert found.eos_ids == (eos,)
    ours = load_checkpoint(found, torch.device("cpu"), torch.float32)
    got = generate(ours, max_new_tokens=12, eos_ids=found.eos_ids)
    assert got == hf_greedy(theirs, PROMPTS, max_new_tokens=12, eos_ids=(eos,))
    assert any(row[-1] == eos and len(row) < 12 for row in got)


def test_a_folder_it_cannot_load_as_transformers_would_says_why(tmp_path):
    folder = save(tmp_path / "m")
    assert "class AutoModel " in find_checkpoint(folder, "AutoModel", {})
    assert "kwargs (revision)" in find_checkpoint(folder, "AutoModelForCausalLM",
                                                  {"revision": "main"})
    config = json.loads((folder / "config.json").read_text())
    dynamic = {**config, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4,
                                             "factor": 2.0}}
    (folder / "config.json").write_text(json.dumps(dynamic))
    assert "rope_type 'dynamic'" in find_checkpoint(folder, "AutoModelForCausalLM", {})
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
    assert "model_type 'gemma'" in find_checkpoint(folder, "AutoModelForCausalLM", {})
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ModelError, match="num_hidden_layers is 3, and the saved weights hold 2"):
        find_checkpoint(folder, "AutoModelForCausalLM", {})  # no reason to hand over: refused
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").rename(folder / "elsewhere.safetensors")
    assert "no model.safetensors" in find_checkpoint(folder, "AutoModelForCausalLM", {})


def write_spec(tmp_path: Path, folder: Path, **hf) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": t}) + "\n"
                               for i, t in enumerate(["the cat sat", "a dog", "once upon"])))
    spec = {"version": 1, "name": "gen", "device": "cpu",
            "model": {"hf": {"path": str(folder), "class": "AutoModelForCausalLM", **hf},
                      "dtype": "float32"},
            "data": {"path": str(prompts), "id_field": "id", "text": {"field": "prompt"},
                     "batch_size": 2},
            "generate": {"max_new_tokens": 4},
            "buckets": {"batch": [2], "seq": [16]},
            "output": {"dir": str(tmp_path / "out"), "format": "jsonl"}}
    path = tmp_path / "gen.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


TINY = ROOT / "examples" / "models" / "tiny-llama"


def completions(out: Path) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for p in sorted(out.glob("part-*.jsonl"))
            for line in p.read_text().splitlines()]


def test_the_manifest_says_whose_code_ran_and_both_give_the_same_completions(tmp_path):
    ours = graphrun.run(graphrun.load_spec(write_spec(tmp_path, TINY)))
    assert ours.environment.model_code == "graphrun"
    assert ours.environment.model_code_reason == (
        "model.hf.implementation auto: graphrun's own Llama loads the folder as transformers' "
        "AutoModelForCausalLM would")
    mine = completions(tmp_path / "out")
    theirs = graphrun.run(graphrun.load_spec(write_spec(tmp_path, TINY,
                                                        implementation="transformers")),
                          overwrite=True)
    assert theirs.environment.model_code == "transformers"
    assert theirs.environment.model_code_reason == "model.hf.implementation: transformers"
    assert completions(tmp_path / "out") == mine
    fallback = graphrun.run(graphrun.load_spec(write_spec(tmp_path, TINY,
                                                          kwargs={"revision": "main"})),
                            overwrite=True)
    assert fallback.environment.model_code == "transformers"
    assert "kwargs (revision)" in fallback.environment.model_code_reason
    named = graphrun.run(graphrun.load_spec(write_spec(tmp_path, TINY,
                                                       implementation="graphrun")),
                         overwrite=True)
    assert (named.environment.model_code, named.environment.model_code_reason) == (
        "graphrun", "model.hf.implementation: graphrun")
    assert completions(tmp_path / "out") == mine


def test_implementation_graphrun_on_a_folder_it_cannot_load_is_one_error(tmp_path):
    spec = write_spec(tmp_path, TINY, implementation="graphrun", kwargs={"revision": "main"})
    with pytest.raises(ModelError, match=r"implementation: graphrun cannot load .*kwargs "
                                         r"\(revision\).*set implementation: auto"):
        graphrun.run(graphrun.load_spec(spec))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "cannot load" in manifest["error"]
    assert not list((tmp_path / "out").glob("part-*"))


def test_a_job_on_graphruns_llama_never_imports_transformers(tmp_path):
    spec = write_spec(tmp_path, TINY)
    assert not imports_transformers(spec)
    assert len(completions(tmp_path / "out")) == 3


def test_transformers_code_in_16_bits_keeps_ropes_frequencies_in_float32(tmp_path):
    """The transformers path casts the weights, not transformers' float32 scratch: RoPE's
    inv_freq rounded to bfloat16 would move every position's angle."""
    from graphrun.models.load import build_model

    folder = save(tmp_path / "m", "llama-tied-bias")
    (folder / "tokenizer.json").write_bytes((TINY / "tokenizer.json").read_bytes())
    spec = graphrun.load_spec(write_spec(tmp_path, folder, implementation="transformers"))
    spec.model.dtype = "bfloat16"
    model = build_model(spec, torch.device("cpu"), spec.base_dir)
    rotary = model.model.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


def test_new_tokens_filling_the_models_positions_is_one_spec_error_naming_the_key(tmp_path):
    """No prompt bucket can fit: the message names max_new_tokens, not a bucket list to end at
    0 or below."""
    from graphrun import SpecError

    spec = write_spec(tmp_path, TINY)
    with pytest.raises(SpecError, match=r"generate.max_new_tokens: 1024 new tokens leave no "
                                        r"room for a prompt in the model's 1024 positions"):
        graphrun.load_spec(spec, ["generate.max_new_tokens=1024"])
    # with buckets planned from the prompts (auto) too, not "every record is too long"
    with pytest.raises(SpecError, match=r"generate.max_new_tokens: 5000 new tokens leave no "
                                        r"room for a prompt"):
        graphrun.load_spec(spec, ["generate.max_new_tokens=5000", "buckets.batch=auto",
                                  "buckets.seq=auto"])


def test_a_checkpoint_in_shards_loads_from_its_index(tmp_path):
    """Real checkpoints come in shards named by model.safetensors.index.json."""
    import transformers

    one = save(tmp_path / "one")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(one).eval()
    theirs.save_pretrained(tmp_path / "shards", max_shard_size="100KB")
    shards = sorted((tmp_path / "shards").glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "shards" / "model.safetensors.index.json").is_file()
    found = find_checkpoint(tmp_path / "shards", "AutoModelForCausalLM", {})
    assert isinstance(found, Checkpoint) and found.files == shards
    ours = load_checkpoint(found, torch.device("cpu"), torch.float32)
    assert generate(ours, max_new_tokens=6) == hf_greedy(theirs, PROMPTS, max_new_tokens=6)
    shards[-1].unlink()
    assert "missing" in find_checkpoint(tmp_path / "shards", "AutoModelForCausalLM", {})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_graphruns_rms_norm_rounds_as_transformers_llama_norm_does(dtype):
    """One fused call in place of transformers' steps (float32 mean square, one rounding,
    then the weight): the same values, to a unit in the last place of the dtype."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from graphrun.models.causal.llama import RMSNorm

    gen = torch.Generator().manual_seed(4)
    ours, theirs = RMSNorm(256, 1e-6), LlamaRMSNorm(256, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.rand(256, generator=gen) + 0.5)
        theirs.weight.copy_(ours.weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    for scale in (1e-3, 1.0, 300.0):
        x = (torch.randn(5, 3, 256, generator=gen) * scale).to(dtype)
        got, want = ours(x), theirs(x)
        assert got.dtype == want.dtype == dtype
        ulp = torch.finfo(dtype).eps * want.float().abs()
        assert ((got.float() - want.float()).abs() <= ulp).all(), (dtype, scale)
