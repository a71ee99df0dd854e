"""A record's own generation parameters, checked: from the fields generate.per_record names, or
from an OpenAI Batch request's body. Each function returns a RequestParams, or the reason the
record is rejected (a bad value, a key graphrun does not serve); nothing is dropped silently.

ENGINE_SERVES names the parameters the generation engine honours row by row. A record asking
for another one, at a value other than the spec's, is rejected here with what to do, until
the engine serves it too.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

from graphrun.spec.generate import MAX_LOGPROBS, GenerateSpec
from graphrun.spec.request import DEFAULT_PARAMS, EXTRA_STOPS, RequestParams

# RequestParams fields the engine takes per row (generate/engine.py's per-row buffers)
ENGINE_SERVES: frozenset[str] = frozenset({
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids",
    "stop_strings", "n", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "logprobs"})
MAX_STOP = 4  # stop strings per request, as OpenAI allows


def shown(v) -> str:
    """A record's value as its JSON reads (null, not None), cut to 80 characters."""
    try:
        text = json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def whole(name: str, v, low: int) -> int | str:
    if type(v) is not int or v < low:
        return f"{name}: {shown(v)} is not a whole number >= {low}"
    return v


def whole_in(name: str, v, low: int, high: int) -> int | str:
    if type(v) is not int or not low <= v <= high:
        return f"{name}: {shown(v)} is not a whole number in [{low}, {high}]"
    return v


def number_in(name: str, v, low: float, high: float, low_open: bool = False) -> float | str:
    ok = (type(v) in (int, float) and math.isfinite(v) and v <= high
          and (v > low if low_open else v >= low))
    if not ok:
        span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        return f"{name}: {shown(v)} is not a number in {span}"
    return float(v)


def stop_strings(name: str, v) -> tuple[str, ...] | str:
    stops = [v] if isinstance(v, str) else v
    if (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)
            or len(stops) > MAX_STOP):
        return f"{name}: {shown(v)} is not a string or a list of up to {MAX_STOP} non-empty strings"
    return tuple(stops)


# parameter -> (check(name, value) -> value or reason, the RequestParams field it sets)
CHECKS = {
    "max_new_tokens": (lambda k, v: whole(k, v, 1), "max_new_tokens"),
    "temperature": (lambda k, v: number_in(k, v, 0, 1e4), "temperature"),
    "top_p": (lambda k, v: number_in(k, v, 0, 1, low_open=True), "top_p"),
    "top_k": (lambda k, v: whole(k, v, 0), "top_k"),
    "min_p": (lambda k, v: number_in(k, v, 0, 1), "min_p"),
    "seed": (lambda k, v: v if type(v) is int else f"{k}: {shown(v)} is not a whole number",
             "seed"),
    "stop": (stop_strings, "stop_strings"),
    "n": (lambda k, v: whole(k, v, 1), "n"),
    "repetition_penalty": (lambda k, v: number_in(k, v, 0, 1e4, low_open=True),
                           "repetition_penalty"),
    "presence_penalty": (lambda k, v: number_in(k, v, -2, 2), "presence_penalty"),
    "frequency_penalty": (lambda k, v: number_in(k, v, -2, 2), "frequency_penalty"),
    "logprobs": (lambda k, v: whole_in(k, v, 0, MAX_LOGPROBS), "logprobs"),
}


# generate.per_record's parameters other than by their own name: as OpenAI's requests name them
PARAM_ALIASES = {"max_new_tokens": ("max_new_tokens", "max_tokens", "max_completion_tokens")}


def named_as_parameters(names) -> dict[str, list[str]]:
    """parameter -> the field names among `names` that are named for it (PARAM_ALIASES, else
    the parameter's own name), in PARAM_ALIASES' order."""
    held = set(names)
    out = {}
    for param in CHECKS:
        found = [n for n in PARAM_ALIASES.get(param, (param,)) if n in held]
        if found:
            out[param] = found
    return out


WHOLE_PARAMS = frozenset({"max_new_tokens", "top_k", "seed", "n", "logprobs"})
EXACT_FLOAT = 2 ** 53  # a float's whole numbers are exact up to here


def params_from_fields(record: dict, per_record: dict[str, str],
                       from_spec: bool = True) -> RequestParams | str:
    """generate.per_record: parameter -> the record field setting it (absent or null: the
    spec's value). A whole number written as a float (16.0) counts as that number: a column
    with nulls holds floats (pandas' float64), and a field's every value would be refused.
    from_spec: a bad value's message names the spec key that maps the field (False: the
    field alone, as a Python call's keyword)."""
    given = {}
    for param, name in per_record.items():
        v = record.get(name)
        if v is None:
            continue
        if (param in WHOLE_PARAMS and type(v) is float and v.is_integer()
                and abs(v) <= EXACT_FLOAT):
            v = int(v)
        check, attr = CHECKS[param]
        got = check(f"{name} (generate.per_record.{param})" if from_spec else name, v)
        if isinstance(got, str):
            return got
        given[attr] = got
    return replace(DEFAULT_PARAMS, **given)


def unserved(params: RequestParams, g: GenerateSpec, output_format: str) -> str:
    """Why the engine cannot serve a record's parameters ("" where it can) in a job of
    generate section `g` writing `output_format`: a value that differs from the spec's for a
    parameter the engine does not take per row."""
    greedy = g.sampling.method == "greedy"
    # parameter -> (the spec's value, the key that sets it)
    spec_value = {"max_new_tokens": (g.max_new_tokens, "generate.max_new_tokens"),
                  "temperature": ((0, "generate.sampling.method greedy (temperature 0)")
                                  if greedy else (g.sampling.temperature,
                                                  "generate.sampling.temperature"))}
    spec_value.update((k, (getattr(g.sampling, k), f"generate.sampling.{k}"))
                      for k in ("top_p", "top_k", "seed"))
    drawn = not greedy or params.temperature not in (None, 0)
    if params.max_new_tokens is not None and params.max_new_tokens > g.max_new_tokens:
        return (f"max_new_tokens {params.max_new_tokens} is more than the job's cap "
                f"(generate.max_new_tokens: {g.max_new_tokens}, which sizes the KV cache): "
                "raise it in the spec")
    if (params.n or 1) > 1 and output_format != "openai_batch":
        return (f"n {params.n}: several samples per prompt are written as an OpenAI Batch "
                "line's choices: set output.format: openai_batch")
    if len(params.stop_token_ids) > EXTRA_STOPS:
        return (f"stop_token_ids: {len(params.stop_token_ids)} ids; the engine takes at most "
                f"{EXTRA_STOPS} a record")
    for name, v in params.given().items():
        if name in ENGINE_SERVES:
            continue
        if name in spec_value:
            value, key = spec_value[name]
            if v == value or (name in ("top_p", "top_k", "seed") and not drawn):
                continue  # the spec's own value; greedy draws nothing to seed or cut
            return (f"{name} {v!r} differs from the spec's ({key}: {value!r}), and this "
                    "graphrun serves one value per job: set it in the spec's generate: "
                    "section, or split the file by it")
        if name == "stop_token_ids" and set(v) <= set(g.stop.token_ids):
            continue  # the spec stops at these already
        return (f"{_named(name)} is not served by this graphrun's generation engine yet: "
                "remove it from the record")
    return ""


def _named(name: str) -> str:
    return {"stop_strings": "stop (strings)", "n": "n > 1 (several samples)",
            "logprobs": "logprobs", "min_p": "min_p",
            "stop_token_ids": "stop token ids"}.get(name, name)
