"""Calling the model: with the static inputs (keyword or positional), its first call's failure
explained, and its return named after the spec's outputs."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from graphrun.base.errors import ModelError, first_message


def unlisted_outputs(ret: Any, names: list[str]) -> list[str]:
    """Keys of a dict the model returns that the spec's outputs do not list (not written)."""
    return [str(k) for k in ret if k not in names] if isinstance(ret, Mapping) else []


_DTYPE_WORDS = ("dtype", "scalar type", "input type", "weight type", "half", "bfloat16",
                "double")


def index_hint(model: nn.Module, specs: dict) -> str:
    """An IndexError in the model is nearly always an integer input's values (its range, or
    its pad at padded positions) past one of the model's nn.Embedding tables: name them."""
    ints = [f"inputs.{n} range " + (f"[{s.range[0]:g}, {s.range[1]:g})" if s.range else "none")
            + f", pad {s.pad:g}" for n, s in specs.items() if s.dtype.startswith(("int", "uint"))]
    tables = sorted({m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)})
    limit = (f"the model's nn.Embedding tables hold {', '.join(map(str, tables))} rows"
             if tables else "the model indexes with them")
    return (f"an index past a table: {'; '.join(ints) or 'no integer input'}; {limit}: set "
            "each input's range to at most its table's rows, and its pad inside the range")


def first_call_error(exc: Exception, model: nn.Module, inputs: dict[str, torch.Tensor],
                     call: str, what: str, specs: dict | None = None) -> ModelError:
    """The model failed on its first call (sample inputs of the largest bucket): nearly always
    the spec and the model disagreeing. Say what was passed and the one change that fits."""
    args = {n: f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}" for n, t in inputs.items()}
    how = "model(" + ", ".join(f"{n}={a}" if call == "keyword" else a
                               for n, a in args.items()) + ")"
    text = first_message(exc)
    params = _forward_params(model)
    if isinstance(exc, TypeError) and ("argument" in text or "positional" in text):
        if call == "keyword":
            hint = ("the model's forward takes other argument names than the spec's inputs: "
                    f"name the inputs after forward's parameters ({', '.join(params) or '?'}), "
                    "or set model.call: positional to pass them in the inputs' order")
        else:
            hint = (f"model.call is positional: forward gets the {len(inputs)} inputs in the "
                    f"order they are listed; forward takes ({', '.join(params) or '?'}): list "
                    "as many inputs, in that order")
    elif isinstance(exc, IndexError) and specs:
        hint = index_hint(model, specs)
    elif any(w in text.lower() for w in _DTYPE_WORDS):
        hint = ("a dtype does not match: floating inputs are cast to model.dtype before the "
                "call, integer and bool inputs are passed as declared; set inputs.<name>.dtype "
                "to what forward expects (an index input as int64, say)")
    else:
        hint = ("check that the spec's inputs (names, shapes, dtypes) match the model's "
                "forward" + (", or set model.call: positional" if call == "keyword" else ""))
    return ModelError(f"the model failed on its first call, {how} for {what}: "
                      f"{type(exc).__name__}: {text}\n  {hint}; --debug shows the traceback")


def first_call(model: nn.Module, inputs: dict[str, torch.Tensor], call: str, what: str,
               specs: dict | None = None) -> Any:
    """The model's return for `inputs` (no grad); `graphrun run` and `graphrun init` both call
    the model first through here, so a mismatch gets the same message from both. specs: the
    spec's inputs, named in the message where an index went past a table."""
    try:
        with torch.inference_mode():
            return call_model(model, inputs, call)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised as a user error, chained
        raise first_call_error(exc, model, inputs, call, what, specs) from exc


def _forward_params(model: nn.Module) -> list[str]:
    try:
        return [n for n, p in inspect.signature(model.forward).parameters.items()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except (TypeError, ValueError, AttributeError):  # a ScriptModule, an exported program
        return []


def call_model(model: nn.Module, inputs: dict[str, torch.Tensor], call: str) -> Any:
    """keyword: model(name=tensor, ...); positional: model(t1, t2, ...) in the inputs' order."""
    if call == "keyword":
        return model(**inputs)
    if call == "positional":
        return model(*inputs.values())
    raise ValueError(f"call must be 'keyword' or 'positional', not {call!r}")


def name_outputs(ret: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """Name the model's return: a tensor (one name), a tuple/list in order, or a dict by key."""
    if isinstance(ret, torch.Tensor):
        if len(names) != 1:
            raise _outputs_error(ret, names, f"return a tuple of {len(names)} tensors in that "
                                 "order or a dict with those keys")
        return {names[0]: ret}
    if isinstance(ret, (tuple, list)):
        if len(ret) != len(names):
            raise _outputs_error(ret, names, "list as many outputs as the model returns, "
                                 "in order")
        named = dict(zip(names, ret))
    elif isinstance(ret, Mapping):
        missing = [n for n in names if n not in ret]
        if missing:
            raise _outputs_error(ret, names, f"the model returns no {missing}; name the "
                                 "outputs after the keys it returns")
        named = {n: ret[n] for n in names}
    else:
        raise _outputs_error(ret, names, "the model must return a tensor, a tuple/list or "
                             "a dict of tensors")
    bad = [n for n, v in named.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise _outputs_error(ret, names, f"outputs {bad} are not tensors")
    return named


def _outputs_error(ret: Any, names: list[str], remedy: str) -> ModelError:
    return ModelError(f"the model returned {describe(ret)}, but the spec's outputs expect "
                     f"{len(names)} named {names}; {remedy}")


def describe(obj: Any) -> str:
    """A short account of a value: what it is and, for tensors, its shape and dtype."""
    if isinstance(obj, torch.Tensor):
        return f"a tensor {list(obj.shape)} {str(obj.dtype).removeprefix('torch.')}"
    if isinstance(obj, (tuple, list)):
        kinds = ", ".join(describe(x) for x in obj[:4]) + (", ..." if len(obj) > 4 else "")
        return f"a {type(obj).__name__} of {len(obj)} ({kinds})"
    if isinstance(obj, Mapping):
        return f"a dict with keys {list(obj)}"
    return f"a {type(obj).__name__}"

