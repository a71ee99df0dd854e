"""Hugging Face model folders read without transformers: config.json and safetensors weights.

graphrun builds some architectures itself (models/causal/llama.py: the Llama family; models/causal/
gpt2.py; models/bert.py), so a job on such a folder never imports transformers, whose import is most of a short job's start. What
is read here is plain data: the config's fields as a typed shape, the checkpoint's tensor names,
the tensors themselves. Whether a folder can be built so is decided from those alone, before
any work (`llama_shape` returns the reason it cannot); the model code is the caller's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphrun.base.errors import ModelError
from graphrun.models.sizes import check_layers
from graphrun.models.weights import Held

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# model_type -> (the family's name, its q/k/v projections' bias)
LLAMA_FAMILY = {"llama": ("Llama", None), "mistral": ("Mistral", False), "qwen2": ("Qwen2", True),
                "qwen3": ("Qwen3", None)}
CAUSAL_LM_CLASSES = ("AutoModelForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                     "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GPT2LMHeadModel")
WINDOW_BY_FLAG = ("qwen2", "qwen3")  # sliding_window applies only with use_sliding_window
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Rope:
    """Rotary embedding's frequencies: theta, and a scaling of rope_type linear or llama3."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_positions: int = 8192


@dataclass(frozen=True)
class LlamaShape:
    """A Llama-family decoder's layout, as its config.json gives it."""

    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    max_len: int
    norm_eps: float = 1e-6
    rope: Rope = Rope()
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tied: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k, before RoPE
    window: int | None = None  # sliding-window attention's width, where the config has one
    family: str = "Llama"


@dataclass(frozen=True)
class GPT2Shape:
    """A GPT-2 decoder's layout, as its config.json gives it."""

    layers: int
    d_model: int
    heads: int
    ffn: int
    vocab: int
    max_len: int
    norm_eps: float = 1e-5
    act: str = "gelu_new"
    scale: bool = True  # scale_attn_weights: q.k / sqrt(head_dim)
    tied: bool = True
    window: None = None  # no sliding window
    family: str = "GPT-2"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu")


def gpt2_shape(config: dict[str, Any]) -> GPT2Shape | str:
    """The config as a GPT2Shape, or why graphrun's GPT-2 cannot reproduce this model."""
    act = config.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        return f"activation_function {act!r} (graphrun's GPT-2 has {', '.join(GPT2_ACTIVATIONS)})"
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention",
                "quantization_config", "auto_map"):
        if config.get(key):
            return f"config.json sets {key}"
    try:
        d_model = whole(config, "n_embd", "hidden_size")
        shape = GPT2Shape(
            layers=whole(config, "n_layer", "num_hidden_layers"), d_model=d_model,
            heads=whole(config, "n_head", "num_attention_heads"),
            ffn=whole(config, "n_inner", default=4 * d_model), vocab=whole(config, "vocab_size"),
            max_len=whole(config, "n_positions", "max_position_embeddings", default=1024),
            norm_eps=float(config.get("layer_norm_epsilon", 1e-5)), act=act,
            scale=bool(config.get("scale_attn_weights", True)),
            tied=bool(config.get("tie_word_embeddings", True)))
    except (KeyError, TypeError, ValueError) as e:
        return f"config.json lacks or mistypes a field graphrun's GPT-2 reads ({e})"
    if shape.d_model % shape.heads:
        return f"n_embd {shape.d_model} is not a multiple of {shape.heads} heads"
    return shape


CONFIG_REMEDY = ("make the folder's config.json describe the saved weights, or save the model "
                 "again with save_pretrained")
_NO_DEFAULT = object()


def whole(config: dict[str, Any], *keys: str, default: Any = _NO_DEFAULT, least: int = 1) -> int:
    """config.json's size under the first of `keys` it has: a whole number of at least `least`
    (2.7 layers, -5 layers, 0 heads are errors, never rounded or built empty); `default` where
    it has none (or null)."""
    key = next((k for k in keys if config.get(k) is not None), None)
    if key is None:
        if default is _NO_DEFAULT:
            raise KeyError(keys[0])
        return default
    value = config[key]
    if type(value) is not int or value < least:
        raise ModelError(f"config.json: {key} is {value!r}, not a whole number of at least "
                         f"{least}; make it describe the saved weights")
    return value


def built_on_meta(where: str, build, shape):
    """build(shape) on the meta device, or one error where the config's sizes make a model no
    tensor can hold (2**30 wide, say)."""
    try:
        return build(shape)
    except (RuntimeError, ValueError, OverflowError) as e:
        raise ModelError(f"{where}: config.json describes a model that cannot be built "
                         f"({type(e).__name__}: {e}); {CONFIG_REMEDY}") from None


def read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: cannot read the model's config ({type(e).__name__}: {e})") \
            from None
    if not isinstance(config, dict):
        raise ModelError(f"{path}: holds no JSON object")
    return config


def llama_shape(config: dict[str, Any]) -> LlamaShape | str:
    """The config as a LlamaShape, or why graphrun's Llama cannot reproduce this model."""
    kind = config.get("model_type")
    if kind not in LLAMA_FAMILY:
        return f"model_type {kind!r} is not one of {', '.join(LLAMA_FAMILY)}"
    family, qkv_bias = LLAMA_FAMILY[kind]
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act {config.get('hidden_act')!r} (graphrun's Llama has silu)"
    for key in ("quantization_config", "auto_map"):
        if config.get(key):
            return f"config.json sets {key}"
    if kind in WINDOW_BY_FLAG and config.get("use_sliding_window"):
        return f"{family} with use_sliding_window"
    rope = _rope(config)
    if isinstance(rope, str):
        return rope
    try:
        d_model, heads = whole(config, "hidden_size"), whole(config, "num_attention_heads")
        head_dim = whole(config, "head_dim", default=d_model // heads)
        bias = bool(config.get("attention_bias", False)) if qkv_bias is None else qkv_bias
        shape = LlamaShape(
            layers=whole(config, "num_hidden_layers"), d_model=d_model, heads=heads,
            kv_heads=whole(config, "num_key_value_heads", default=heads), head_dim=head_dim,
            ffn=whole(config, "intermediate_size"), vocab=whole(config, "vocab_size"),
            max_len=whole(config, "max_position_embeddings", default=2048),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope=rope, qkv_bias=bias,
            o_bias=bias if kind in ("llama", "qwen3") else False,
            mlp_bias=bool(config.get("mlp_bias", False)),
            tied=bool(config.get("tie_word_embeddings", False)),
            qk_norm=kind == "qwen3",
            window=(int(config["sliding_window"]) if config.get("sliding_window")
                    and kind not in WINDOW_BY_FLAG else None),
            family=family)
    except (KeyError, TypeError, ValueError) as e:
        return f"config.json lacks or mistypes a field graphrun's Llama reads ({e})"
    if shape.heads % shape.kv_heads or shape.head_dim % 2:
        return (f"{shape.heads} heads over {shape.kv_heads} kv heads of width "
                f"{shape.head_dim}: not a layout graphrun's Llama takes")
    return shape


def _rope(config: dict[str, Any]) -> Rope | str:
    """transformers 5 writes rope_parameters; 4.x wrote rope_theta and rope_scaling."""
    params = config.get("rope_parameters") or {}
    if isinstance(params, dict) and params and "rope_theta" not in params \
            and "rope_type" not in params:
        return "rope_parameters per attention kind (not one set for the model)"
    scaling = config.get("rope_scaling") or {}
    merged = {**scaling, **params} if isinstance(params, dict) else dict(scaling)
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ROPE_TYPES:
        return f"rope_type {kind!r} (graphrun's Llama has {', '.join(ROPE_TYPES)})"
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial_rotary_factor"
    theta = float(merged.get("rope_theta", config.get("rope_theta", 10000.0)))
    if kind == "default":
        return Rope(theta=theta)
    try:
        factor = float(merged["factor"])
        if kind == "linear":
            return Rope(theta=theta, kind=kind, factor=factor)
        return Rope(theta=theta, kind=kind, factor=factor,
                    low_freq_factor=float(merged["low_freq_factor"]),
                    high_freq_factor=float(merged["high_freq_factor"]),
                    original_positions=int(merged["original_max_position_embeddings"]))
    except (KeyError, TypeError, ValueError) as e:
        return f"rope_type {kind!r} without its parameter {e}"


def inv_freq(rope: Rope, head_dim: int):
    """RoPE's inverse frequencies [head_dim / 2] float32 on the CPU, scaled as rope.kind says
    (the formulas of the Llama papers, as transformers applies them)."""
    import torch

    freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64)
                                 .float() / head_dim))
    if rope.kind == "linear":
        return freq / rope.factor
    if rope.kind == "llama3":
        low = rope.original_positions / rope.low_freq_factor  # wavelengths past: slowed
        high = rope.original_positions / rope.high_freq_factor  # below: kept
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low, freq / rope.factor, freq)
        smooth = ((rope.original_positions / wavelen - rope.low_freq_factor)
                  / (rope.high_freq_factor - rope.low_freq_factor))
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high) & ~(wavelen > low)
        return torch.where(medium, blended, scaled)
    return freq


def read_folder(folder: str | Path, kwargs: dict
                ) -> tuple[dict[str, Any], list[Path], dict[str, Held]] | str:
    """(config.json, the safetensors files, their tensors' headers) of a folder graphrun's own
    code may load, or why it may not (then transformers' loading reports in its words)."""
    if kwargs:
        return f"model.hf.kwargs ({', '.join(sorted(kwargs))}) are from_pretrained's"
    try:
        config = read_config(folder)
    except ModelError as e:
        return str(e)
    files = weight_files(folder)
    if isinstance(files, str):
        return files
    headers = tensor_headers(files)
    if isinstance(headers, str):
        return headers
    check_layers(f"model.hf {str(folder)!r}", config, headers)  # before any module is built
    return config, files, headers


def eos_ids_in(folder: str | Path) -> tuple[int, ...]:
    """The EOS ids a folder names: generation_config.json's, else config.json's, as
    transformers reads them."""
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((Path(folder) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()


def weight_files(folder: str | Path) -> list[Path] | str:
    """The folder's safetensors files (one, or the shards its index names), or why not."""
    folder = Path(folder)
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    index = folder / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"{INDEX} unreadable ({type(e).__name__})"
        missing = [n for n in names if not (folder / n).is_file()]
        return [folder / n for n in names] if not missing else f"shard {missing[0]} missing"
    return f"no {WEIGHTS} (graphrun reads safetensors weights only)"


def tensor_headers(files: list[Path]) -> dict[str, Held] | str:
    """Every tensor's shape and dtype by name in the files (their headers only), or why they
    cannot be read."""
    try:
        from safetensors import safe_open
    except ImportError:
        return "the safetensors package is not installed"
    headers: dict[str, Held] = {}
    try:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    t = f.get_slice(name)
                    headers[name] = Held(tuple(t.get_shape()), t.get_dtype())
    except Exception as e:  # noqa: BLE001 - a corrupt header: transformers reports it
        return f"{path.name} unreadable ({type(e).__name__})"
    return headers


def load_tensors(files: list[Path], device) -> dict[str, Any]:
    """The files' tensors read onto `device`, as saved (the caller casts)."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for path in files:
        tensors.update(load_file(str(path), device=str(device)))
    return tensors
