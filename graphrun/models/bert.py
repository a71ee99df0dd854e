"""graphrun's BERT encoder: a Hugging Face BERT folder (all-MiniLM-L6-v2, bge, e5, ...) saved
as safetensors, run without transformers, whose import is most of a short embedding job's start.

Parameters carry transformers' names (embeddings.word_embeddings.weight,
encoder.layer.0.attention.self.query.weight, ...), so the checkpoint loads as saved, and the
arithmetic is BertModel's: embeddings summed then normed, post-norm layers, exact GELU, the
tanh pooler on the first token. forward takes BertModel's input names and returns its two
fields, last_hidden_state and pooler_output, as a dict (models/call.py names the outputs), or
last_hidden_state alone for an encoder saved without its pooler that no output reads;
BertForSequenceClassification (a classifier, a cross-encoder) returns its logits. Equal to
transformers' classes within float rounding (tests/test_bert_native.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from graphrun.base.errors import ModelError
from graphrun.models.builtin.seeded import on_meta
from graphrun.models.checkpoint import (CONFIG_REMEDY, built_on_meta, load_tensors,
                                        read_folder, whole)
from graphrun.models.sizes import check_fits, tensor_bytes
from graphrun.models.weights import compare, held, weights_error

ENCODERS = ("AutoModel", "BertModel")
CLASSIFIERS = ("AutoModelForSequenceClassification", "BertForSequenceClassification")
ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}
PREFIX = "bert."  # a task model's checkpoint (BertForMaskedLM, ...) holds its encoder so
HEADS = ("cls.", "classifier.", "qa_outputs.")  # a task model's heads: not the encoder's
POOLER = "pooler."  # the tanh pooler's weights, which add_pooling_layer=False does not save
POOLED = "pooler_output"
POSITION_IDS = "embeddings.position_ids"  # a buffer older transformers saved


@dataclass(frozen=True)
class BertShape:
    layers: int
    d_model: int
    heads: int
    ffn: int
    vocab: int
    positions: int
    type_vocab: int
    norm_eps: float
    act: str


class SelfAttention(nn.Module):
    def __init__(self, s: BertShape):
        super().__init__()
        self.heads = s.heads
        self.query = nn.Linear(s.d_model, s.d_model)
        self.key = nn.Linear(s.d_model, s.d_model)
        self.value = nn.Linear(s.d_model, s.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, d = x.shape  # x [b, s, d]; mask [b, 1, 1, s] bool or None
        q, k, v = (proj(x).view(b, n, self.heads, d // self.heads).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [b, heads, s, d / heads]
        return y.transpose(1, 2).reshape(b, n, d)


class Dense(nn.Module):
    """A projection, then the residual added and normed (BertSelfOutput and BertOutput)."""

    def __init__(self, width_in: int, s: BertShape):
        super().__init__()
        self.dense = nn.Linear(width_in, s.d_model)
        self.LayerNorm = nn.LayerNorm(s.d_model, eps=s.norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, s: BertShape):
        super().__init__()
        self.self = SelfAttention(s)
        self.output = Dense(s.d_model, s)


class Intermediate(nn.Module):
    def __init__(self, s: BertShape):
        super().__init__()
        self.dense = nn.Linear(s.d_model, s.ffn)
        self.act = ACTIVATIONS[s.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, s: BertShape):
        super().__init__()
        self.attention = Attention(s)
        self.intermediate = Intermediate(s)
        self.output = Dense(s.ffn, s)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attention.output(self.attention.self(x, mask), x)
        return self.output(self.intermediate(x), x)


class Embeddings(nn.Module):
    def __init__(self, s: BertShape):
        super().__init__()
        self.word_embeddings = nn.Embedding(s.vocab, s.d_model)
        self.position_embeddings = nn.Embedding(s.positions, s.d_model)
        self.token_type_embeddings = nn.Embedding(s.type_vocab, s.d_model)
        self.LayerNorm = nn.LayerNorm(s.d_model, eps=s.norm_eps)


class Encoder(nn.Module):
    def __init__(self, s: BertShape):
        super().__init__()
        self.layer = nn.ModuleList(Layer(s) for _ in range(s.layers))


class Pooler(nn.Module):
    def __init__(self, s: BertShape):
        super().__init__()
        self.dense = nn.Linear(s.d_model, s.d_model)


class Bert(nn.Module):
    """pooler False: an encoder saved without its pooler, which returns last_hidden_state
    alone (find_bert builds it so only where no output reads pooler_output)."""

    def __init__(self, shape: BertShape, pooler: bool = True):
        super().__init__()
        self.shape = shape
        self.embeddings = Embeddings(shape)
        self.encoder = Encoder(shape)
        self.pooler = Pooler(shape) if pooler else None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        # input_ids [b, s] -> last_hidden_state [b, s, d], pooler_output [b, d]
        e = self.embeddings
        n = input_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(n, device=input_ids.device)[None]
        types = (e.token_type_embeddings.weight[0] if token_type_ids is None
                 else e.token_type_embeddings(token_type_ids))
        x = e.LayerNorm(e.word_embeddings(input_ids) + types + e.position_embeddings(position_ids))
        mask = None
        if attention_mask is not None:
            keys = attention_mask.bool()  # [b, s]
            # a row of padding only (a bucket's spare row) attends to every key: finite, unread
            keys = keys | ~keys.any(dim=-1, keepdim=True)
            mask = keys[:, None, None, :]
        for layer in self.encoder.layer:
            x = layer(x, mask)
        if self.pooler is None:
            return {"last_hidden_state": x}
        return {"last_hidden_state": x, POOLED: torch.tanh(self.pooler.dense(x[:, 0]))}


def bert_shape(config: dict) -> BertShape | str:
    """The config as a BertShape, or why graphrun's BERT cannot reproduce the model."""
    if config.get("model_type") != "bert":
        return f"model_type {config.get('model_type')!r} (graphrun's encoder is BERT's)"
    act = config.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        return f"hidden_act {act!r} (graphrun's BERT has {', '.join(ACTIVATIONS)})"
    if config.get("position_embedding_type", "absolute") != "absolute":
        return f"position_embedding_type {config['position_embedding_type']!r}"
    for key in ("is_decoder", "add_cross_attention", "quantization_config", "auto_map"):
        if config.get(key):
            return f"config.json sets {key}"
    try:
        shape = BertShape(layers=whole(config, "num_hidden_layers"),
                          d_model=whole(config, "hidden_size"),
                          heads=whole(config, "num_attention_heads"),
                          ffn=whole(config, "intermediate_size"),
                          vocab=whole(config, "vocab_size"),
                          positions=whole(config, "max_position_embeddings", default=512),
                          type_vocab=whole(config, "type_vocab_size", default=2),
                          norm_eps=float(config.get("layer_norm_eps", 1e-12)), act=act)
    except (KeyError, TypeError, ValueError) as e:
        return f"config.json lacks or mistypes a field graphrun's BERT reads ({e})"
    if shape.d_model % shape.heads:
        return f"hidden_size {shape.d_model} is not a multiple of {shape.heads} heads"
    return shape


class BertClassifier(nn.Module):
    """BertForSequenceClassification: the encoder's pooled output through a linear layer;
    returns {"logits": [b, labels]} (a cross-encoder's relevance score where labels is 1)."""

    def __init__(self, shape: BertShape, labels: int):
        super().__init__()
        self.bert = Bert(shape)
        self.classifier = nn.Linear(shape.d_model, labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        pooled = self.bert(input_ids, attention_mask, token_type_ids,
                           position_ids)["pooler_output"]
        return {"logits": self.classifier(pooled)}


@dataclass(frozen=True)
class BertCheckpoint:
    folder: Path
    shape: BertShape
    files: list[Path]
    labels: int | None  # a sequence classifier's; None for the encoder alone
    prefix: str  # "bert." where a task model saved the encoder loaded alone, else ""
    pooler: bool = True  # False: saved without it, and built without it
    elements: int = 0  # the saved tensors' values, all together


def _build(shape: BertShape, labels: int | None, pooler: bool = True) -> nn.Module:
    return Bert(shape, pooler) if labels is None else BertClassifier(shape, labels)


def reads_pooler(outputs: dict) -> list[str]:
    """The names of the spec's outputs (name -> OutputSpec) that read BertModel's
    pooler_output: by name, by from, or by its tuple position (1, -1) in the return."""
    def reads(name, o) -> bool:
        field = o.from_ if o.reduced else name
        return field == POOLED or (isinstance(field, int) and field in (1, -1))
    return [name for name, o in outputs.items() if reads(name, o)]


def find_bert(folder: str | Path, class_: str, kwargs: dict,
              pooled_by: list[str] | None = None) -> BertCheckpoint | str:
    """The folder as a BertCheckpoint, or why graphrun's BERT cannot load it as transformers'
    BertModel or BertForSequenceClassification would: from config.json and the safetensors
    headers only. pooled_by: the outputs that read pooler_output (reads_pooler); an encoder
    saved without its pooler (and missing nothing else) is built without it where there are
    none, and is an error where there are (transformers would make the pooler up at random);
    None: not known, so every weight must be there."""
    if class_ not in ENCODERS + CLASSIFIERS:
        return f"class {class_} (graphrun's BERT loads {', '.join(ENCODERS + CLASSIFIERS)})"
    read = read_folder(folder, kwargs)
    if isinstance(read, str):
        return read
    config, files, headers = read
    where = f"model.hf {str(folder)!r}"
    try:
        shape = bert_shape(config)
    except ModelError as e:  # a size no model has: transformers' class would fail on it too
        raise ModelError(f"{where}: {e}") from None
    if isinstance(shape, str):
        return shape
    labels = None
    if class_ in CLASSIFIERS:
        labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 2))
    saved = {n: h for n, h in headers.items() if not n.endswith(POSITION_IDS)}
    prefix = ""
    if labels is None and saved and all(n.startswith((PREFIX, *HEADS)) for n in saved):
        prefix = PREFIX  # the encoder of a task model's checkpoint; its heads left out
        saved = {n[len(PREFIX):]: h for n, h in saved.items() if n.startswith(PREFIX)}
    with on_meta():
        differ = compare(held(built_on_meta(where, lambda s: _build(s, labels), shape)
                              .state_dict()), saved)
    pooler = True
    if (labels is None and pooled_by is not None and differ.missing and not differ.unexpected
            and all(n.startswith(POOLER) for n in differ.missing)):
        if pooled_by:
            raise ModelError(
                f"{where} holds no pooler weights (saved with add_pooling_layer=False) but "
                f"outputs.{pooled_by[0]} reads {POOLED}: read last_hidden_state instead (from: "
                "last_hidden_state, with reduce: [cls_pool] or [mean_pool]), or give a folder "
                "saved with its pooler")
        pooler, differ.missing = False, []  # built without it: nothing is made up
    if differ.missing or differ.unexpected:  # a missing pooler, say: transformers decides
        kind = "BertModel's" if labels is None else "BertForSequenceClassification's"
        return (f"the weights' names are not {kind} (missing {differ.missing[:2]}, "
                f"unexpected {differ.unexpected[:2]})")
    if differ:
        raise weights_error(where, differ, CONFIG_REMEDY)
    return BertCheckpoint(Path(folder), shape, files, labels, prefix, pooler,
                          tensor_bytes((h.shape for h in headers.values()), 1))


def load_bert(found: BertCheckpoint, dtype: torch.dtype | None) -> nn.Module:
    """The checkpoint's weights in graphrun's BERT on the CPU, cast to `dtype` as read."""
    size = dtype.itemsize if dtype is not None else 4
    check_fits(f"model.hf {str(found.folder)!r}", found.elements * size, dtype or "float32",
               "cpu", "give a smaller model.dtype (bfloat16 halves it) or more memory")
    with on_meta():
        model = _build(found.shape, found.labels, found.pooler)
    want = set(model.state_dict())
    weights = {}
    for name, t in load_tensors(found.files, "cpu").items():
        name = name[len(found.prefix):] if name.startswith(found.prefix) else name
        if name in want:
            weights[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    if set(weights) != want:
        raise ModelError(f"model.hf {str(found.folder)!r}: the weights changed since they were "
                         "checked; run again")
    model.load_state_dict(weights, assign=True)
    return model.eval()
