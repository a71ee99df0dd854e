"""The shipped generation example: examples/models/tiny-llama loads offline as a causal LM with
its tokenizer, generates, and make_tiny_llama.py writes it again byte for byte."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "examples" / "models" / "tiny-llama"
PROMPTS = ROOT / "examples" / "data" / "prompts.jsonl"


def _script():
    spec = importlib.util.spec_from_file_location(
        "make_tiny_llama", ROOT / "examples" / "models" / "make_tiny_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prompts() -> list[dict]:
    return [json.loads(line) for line in PROMPTS.read_text().splitlines()]


def test_the_folder_is_small_and_holds_what_from_pretrained_reads():
    names = {p.name for p in FOLDER.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= names
    assert sum(p.stat().st_size for p in FOLDER.iterdir()) < 2 * 2**20
    assert json.loads((FOLDER / "generation_config.json").read_text())["eos_token_id"] == 1


def test_tokenizer_loads_offline_with_bos_eos_pad_and_left_padding(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = transformers.AutoTokenizer.from_pretrained(FOLDER)
    assert (len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (512, 0, 1, 1)
    assert tok.padding_side == "left"
    text = _prompts()[0]["prompt"]
    ids = tok(text)["input_ids"]
    assert ids[0] == 0 and tok.decode(ids, skip_special_tokens=True) == text


def test_prompts_vary_in_length_from_a_few_words_to_a_few_hundred_tokens():
    records = _prompts()
    assert len(records) == 200 and len({r["id"] for r in records}) == 200
    tok = transformers.AutoTokenizer.from_pretrained(FOLDER)
    lengths = sorted(len(tok(r["prompt"])["input_ids"]) for r in records)
    assert lengths[0] <= 8 and 200 <= lengths[-1] <= 512
    assert lengths[len(lengths) // 2] < 100  # long-tailed: the median is short


@pytest.mark.slow
def test_the_model_generates_on_a_left_padded_batch(monkeypatch):
    import torch

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = transformers.AutoTokenizer.from_pretrained(FOLDER)
    model = transformers.AutoModelForCausalLM.from_pretrained(FOLDER)
    assert type(model).__name__ == "LlamaForCausalLM"
    batch = tok([r["prompt"] for r in _prompts()[:4]], return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=6, do_sample=False)
    assert out.shape == (4, batch["input_ids"].shape[1] + 6)
    # a row alone generates what it generates in the padded batch (positions from the mask)
    alone = tok([_prompts()[1]["prompt"]], return_tensors="pt")
    with torch.inference_mode():
        one = model.generate(**alone, max_new_tokens=6, do_sample=False)
    assert one[0, -6:].tolist() == out[1, -6:].tolist()


def test_the_script_writes_the_same_bytes_again(tmp_path):
    _script().write_all(tmp_path / "model", tmp_path / "prompts.jsonl")
    again = "; `python3 examples/models/make_tiny_llama.py` writes the shipped files again"
    assert (tmp_path / "prompts.jsonl").read_bytes() == PROMPTS.read_bytes(), again
    for path in FOLDER.iterdir():
        written, shipped = (tmp_path / "model" / path.name).read_bytes(), path.read_bytes()
        if path.name.endswith("config.json"):  # the writing transformers' version: not the model
            written, shipped = _without_version(written), _without_version(shipped)
        assert written == shipped, \
            f"{path.name} differs (another transformers or tokenizers?){again}"


def _without_version(config: bytes) -> dict:
    loaded = json.loads(config)
    loaded.pop("transformers_version", None)
    return loaded
