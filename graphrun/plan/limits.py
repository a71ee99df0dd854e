"""What no planned bucket may pass: the model's position table (for a generation job's prompts,
less generate.max_new_tokens, which share it), the tokenizer's length and data.text's
truncation length. A plan past them would capture graphs the model cannot run."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from graphrun.spec.keys import PipelineSpec


@dataclass(frozen=True)
class Limit:
    value: int  # the axis' largest allowed bucket
    cut: bool  # data.text.truncate: longer texts are cut here (else rejected)
    why: str  # what sets it, for the plan's message and the spec's comment


def axis_limits(spec: PipelineSpec) -> dict[str, Limit]:
    """The seq axis of a Hugging Face model (or of tokenized text) -> its limit; {} where
    nothing is known (a target model's positions are its own business)."""
    from graphrun.generate.records import with_implied_io
    from graphrun.read.text import seq_axis

    spec = with_implied_io(spec)  # a generation job's prompts: its implied inputs
    axis = seq_axis(spec)
    if axis is None or (spec.model.hf is None and spec.data.text is None):
        return {}
    found: list[tuple[int, str]] = []
    if spec.model.hf is not None:
        found += _positions(_model_folder(spec), spec.generate)
    elif spec.generate is not None and spec.model.builtin == "llama":
        found += _builtin_positions(spec)
    text = spec.data.text
    if text is not None:
        from graphrun.models.hf import tokenizer_folder
        from graphrun.read.text import max_length

        folder = tokenizer_folder(spec)
        found += _tokenizer_length(folder)
        if text.max_length is not None:
            found.append((text.max_length, "data.text.max_length"))
        elif text.truncate and spec.buckets.get(axis, "auto") != "auto":
            # with truncate on and no max_length, the spec's largest bucket is where texts
            # are cut: a plan must keep that length, not change what the run computes
            found.append((max_length(spec, folder), "the spec's truncation length (its "
                          "largest seq bucket; set data.text.max_length to change it)"))
    if not found:
        return {}
    value, why = min(found)
    return {axis: Limit(value, bool(text is not None and text.truncate), why)}


def _model_folder(spec: PipelineSpec) -> Path | None:
    from graphrun.base.errors import GraphrunError
    from graphrun.models.hf import model_folder

    try:
        return Path(model_folder(spec))
    except GraphrunError:
        return None  # not found here: the run says so where it loads the model


def _positions(folder: Path | None, generate) -> list[tuple[int, str]]:
    """The model's positions; a generation job's prompt shares them with its new tokens."""
    from graphrun.spec.paths import model_positions

    found = model_positions(folder) if folder else None
    if found is None:
        return []
    value, key = found
    if generate is None:
        return [(value, f"the model's {value} positions (config.json's {key})")]
    new = generate.max_new_tokens
    return [(max(1, value - new), f"the model's {value} positions (config.json's {key}) less "
             f"generate.max_new_tokens ({new})")]


def _builtin_positions(spec: PipelineSpec) -> list[tuple[int, str]]:
    """The builtin llama's max_len (model.args, else its builder's default), less the new
    tokens."""
    import inspect

    from graphrun.models.causal.llama import build_llama

    value = spec.model.args.get("max_len",
                                inspect.signature(build_llama).parameters["max_len"].default)
    new = spec.generate.max_new_tokens
    return [(max(1, int(value) - new), f"the builtin llama's max_len ({value}) less "
             f"generate.max_new_tokens ({new})")]


def _tokenizer_length(folder: str) -> list[tuple[int, str]]:
    """The tokenizer's model_max_length (a sentence-transformers max_seq_length is where its
    encode() cuts by choice, not a limit of the model: init --hf reads it, a plan does not)."""
    value = _json(Path(folder) / "tokenizer_config.json").get("model_max_length")
    if isinstance(value, (int, float)) and 0 < value < 1 << 20:  # 1e30 means "no limit"
        return [(int(value), "the tokenizer's model_max_length")]
    return []


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
