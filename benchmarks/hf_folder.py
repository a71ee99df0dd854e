"""A Hugging Face Llama folder of one of bench_decode_step.py's layouts, with graphrun's builtin
Llama's seeded weights: what the whole-process benchmarks hand to `graphrun init --hf` and to
transformers' `from_pretrained`, so every way runs the very same weights.

The folder holds config.json (LlamaConfig), generation_config.json (the EOS ids given: a job's
stop ids, as a model's own), the weights as safetensors (shards of at most SHARD_BYTES with
model.safetensors.index.json past that, as save_pretrained writes them) and a word-level
tokenizer whose word "t<id>" is token <id>, so a text prompt tokenizes back to exactly the ids
the in-process ways are given.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from benchmarks.bench_decode_step import LAYOUTS

PAD = 0  # token 0 pads; prompts never hold it
SHARD_BYTES = 5 << 30  # save_pretrained's default largest shard


def llama_config(layout: str, max_positions: int, eos_ids: tuple[int, ...] = ()):
    """transformers' LlamaConfig of the layout, with the builtin's norm eps and RoPE."""
    from transformers import LlamaConfig

    s = LAYOUTS[layout]
    return LlamaConfig(hidden_size=s["d_model"], num_hidden_layers=s["layers"],
                       num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                       intermediate_size=s["ffn"], vocab_size=s["vocab"],
                       max_position_embeddings=max_positions, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, bos_token_id=None,
                       eos_token_id=list(eos_ids) or None, pad_token_id=PAD,
                       architectures=["LlamaForCausalLM"])


def write_folder(layout: str, folder: Path, *, device: torch.device, dtype: torch.dtype,
                 max_positions: int, eos_ids: tuple[int, ...] = (), seed: int = 0) -> dict:
    """The folder (see the module docstring); returns its weights' bytes, shards and the
    seconds spent building the model and writing it."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from graphrun.models.causal.llama import build_llama

    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = build_llama(**LAYOUTS[layout], max_len=max_positions, seed=seed, device=device,
                        dtype=dtype)
    state = model.state_dict()
    del model
    built = time.perf_counter() - t0
    shards, size = [{}], 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name], size = t, size + n
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in zip(names, shards):
        # one shard on the host at a time: an 8B layout's 16 GB never sits there whole
        save_file({k: t.contiguous().cpu() for k, t in shard.items()}, str(folder / name),
                  metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in state.values())
    if len(shards) > 1:
        weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    del state, shards
    if device.type == "cuda":
        torch.cuda.empty_cache()
    llama_config(layout, max_positions, eos_ids).to_json_file(str(folder / "config.json"))
    GenerationConfig(eos_token_id=list(eos_ids) or None, pad_token_id=PAD,
                     bos_token_id=None).save_pretrained(folder)
    save_id_tokenizer(folder, LAYOUTS[layout]["vocab"], max_positions)
    return {"weight_bytes": total, "shards": len(names), "build_s": built,
            "write_s": time.perf_counter() - t0 - built}


def save_id_tokenizer(folder: Path, vocab: int, max_positions: int) -> None:
    """A word-level tokenizer whose word t<id> is token <id>, no special tokens added."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=f"t{PAD}", unk_token="t0",
                            padding_side="left", model_max_length=max_positions
                            ).save_pretrained(folder)


def as_text(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def write_prompts(path: Path, prompts: list[list[int]]) -> None:
    """A JSONL prompts file as a user has one: an id and the prompt's text."""
    with path.open("w") as f:
        for i, ids in enumerate(prompts):
            f.write(json.dumps({"id": i, "prompt": as_text(ids)}) + "\n")
