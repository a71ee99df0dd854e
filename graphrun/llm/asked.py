"""What a caller of graphrun.generate / LLM.chat asks, as the engine takes it: each prompt's
token ids, record id and own parameters, checked all at once before any work.

A prompt is a string (tokenized as the spec's data.text tokenizes a record's text), a list of
token ids (used as given), a conversation (OpenAI messages, rendered by the model's chat
template as data.chat renders a record's), or a dict holding one of these under `prompt` or
`messages`, with an optional `id` and its own parameters (PARAMS). LLM.chat takes conversations
only: a dict's `messages`, never its `prompt`. The call's parameters apply to every prompt; a
dict's own win.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from numbers import Integral

import numpy as np

from graphrun.base.errors import InputError
from graphrun.read.chat import chat_template, check_messages
from graphrun.read.prompts import Prompt
from graphrun.read.requests import CHECKS, params_from_fields, shown, unserved
from graphrun.read.text import tokenize
from graphrun.spec.keys import PipelineSpec
from graphrun.spec.request import DEFAULT_PARAMS, EXTRA_STOPS, RequestParams

# the keys a prompt's dict may give its own value of (and the call may give for all)
PARAMS = (*CHECKS, "stop_token_ids")
# served by the job's engine but not returned by GenerateOutput yet (several completions, the
# logprob lists) or not built into the in-process engine (the penalties' count buffers)
NOT_IN_PROCESS = {"n": "n > 1 (several samples)", "logprobs": "logprobs",
                  "repetition_penalty": "repetition_penalty",
                  "presence_penalty": "presence_penalty",
                  "frequency_penalty": "frequency_penalty"}


def not_in_process(params: RequestParams) -> str:
    """Why graphrun.generate cannot serve these parameters ("" where it can)."""
    asked = [NOT_IN_PROCESS[k] for k, v in params.given().items()
             if k in NOT_IN_PROCESS and not (k == "n" and v == 1)]
    return (f"{asked[0]} is served by `graphrun run` (a spec's generate: section), not yet by "
            "graphrun.generate: remove it" if asked else "")
PROMPT_KEYS = ("prompt", "messages")


@dataclass(frozen=True)
class Asked:
    """The engine's input for one call, in the caller's order."""

    prompts: list[list[int]]  # token ids
    record_ids: list  # each record's sampling stream
    params: list[RequestParams | None]  # None: the spec's values


def call_params(given: dict) -> RequestParams:
    """The call's **params, checked as a record's own are."""
    unknown = sorted(set(given) - set(PARAMS))
    if unknown:
        raise InputError(f"unknown parameter {unknown[0]!r}: give {', '.join(PARAMS)}",
                         where="generate")
    got = _params(given, DEFAULT_PARAMS)
    if isinstance(got, str):
        raise InputError(got, where="generate")
    return got


def _params(record: dict, base: RequestParams) -> RequestParams | str:
    """base with the record's own values of PARAMS, or why one is bad."""
    got = params_from_fields(record, {k: k for k in CHECKS if k in record}, from_spec=False)
    if isinstance(got, str):
        return got
    own = got.given()
    stops = record.get("stop_token_ids")
    if stops is not None:
        if (not isinstance(stops, (list, tuple)) or len(stops) > EXTRA_STOPS
                or not all(type(t) is int and t >= 0 for t in stops)):
            return (f"stop_token_ids: {stops!r} is not a list of up to {EXTRA_STOPS} token ids")
        own["stop_token_ids"] = tuple(stops)
    return replace(base, **own)


def ask(spec: PipelineSpec, items, base: RequestParams, vocab: int, *,
        chat: bool = False, too_long: str | None = None) -> Asked:
    """items (one prompt, or a list of them; with chat, each a conversation) -> Asked, or one
    InputError naming every bad prompt by its place in the list (too_long: what a reason for
    too many tokens says to do; default: the spec's keys)."""
    if (isinstance(items, (str, dict)) or (chat and _is_messages(items))
            or (not chat and _is_token_ids(items))):
        items = [items]
    if not isinstance(items, (list, tuple)):
        raise InputError(f"expected a list of prompts, got {type(items).__name__}",
                         where="generate")
    problems: dict[int, str] = {}
    texts: dict[int, Prompt] = {}  # place -> its text, tokenized together below
    ids: list[list[int] | None] = [None] * len(items)
    record_ids, params = list(range(len(items))), [None] * len(items)
    for i, item in enumerate(items):
        record = {"messages": item} if chat and not isinstance(item, dict) else item
        if not isinstance(record, dict):
            record = {"prompt": record}
        got = _one(spec, record, base, vocab, chat)
        if isinstance(got, str):
            problems[i] = got
            continue
        prompt, own = got
        record_ids[i] = record.get("id", i)
        params[i] = None if own.is_default else own
        if isinstance(prompt, Prompt):
            texts[i] = prompt
        else:
            ids[i] = prompt
    if texts:
        at = sorted(texts)
        fields, bad, _ = tokenize(spec, [texts[i] for i in at], too_long=too_long)
        arrays = fields["input_ids"].arrays
        for k, i in enumerate(at):
            if k in bad:
                problems[i] = bad[k]
            else:
                ids[i] = arrays[k].tolist()
    if problems:
        listed = [f"[{i}] {why}" for i, why in sorted(problems.items())[:5]]
        more = len(problems) - len(listed)
        raise InputError("; ".join(listed) + (f"; and {more} more" if more > 0 else ""),
                         where=f"generate: {len(problems)} of {len(items)} prompts")
    return Asked(ids, record_ids, params)


def _is_token_ids(items) -> bool:
    """A single prompt of token ids (a list of ints: an int is no prompt of its own)."""
    items = _as_list(items)
    return (isinstance(items, (list, tuple)) and bool(items)
            and all(_is_id(t) for t in items))


def _is_id(t) -> bool:
    """A token id: an int, numpy's included (a tokenizer's arrays hold them); a bool is none."""
    return isinstance(t, Integral) and not isinstance(t, (bool, np.bool_))


def _as_list(value):
    """A 1-d numpy array of token ids as the list it holds; anything else as it is."""
    return value.tolist() if isinstance(value, np.ndarray) and value.ndim == 1 else value


def _is_messages(items) -> bool:
    """A single conversation (a list of message dicts) rather than a list of them."""
    return isinstance(items, list) and bool(items) and all(
        isinstance(m, dict) and "role" in m for m in items)


def _one(spec: PipelineSpec, record: dict, base: RequestParams, vocab: int, chat: bool
         ) -> tuple[Prompt | list[int], RequestParams] | str:
    """(a text to tokenize or token ids, its parameters), or why the prompt is refused."""
    if chat and "prompt" in record:  # as vLLM's LLM.chat: a plain prompt is no conversation
        return ("'prompt' is a plain prompt, which chat() does not take: give a conversation "
                "as messages, or the prompt to generate()")
    keys = ("messages",) if chat else PROMPT_KEYS
    named = [k for k in keys if k in record]
    if len(named) != 1:
        return "give messages" if chat else f"give one of {' or '.join(keys)}"
    unknown = sorted(set(record) - {*keys, "id", *PARAMS})
    if unknown:
        return f"unknown key {unknown[0]!r}: give {' or '.join(keys)}, id, {', '.join(PARAMS)}"
    own = _params(record, base)
    if isinstance(own, str):
        return own
    # a job's advice does not serve a call
    why = not_in_process(own) or unserved(own, spec.generate, spec.output.format)
    if why:
        return why
    value = record[named[0]]
    if named[0] == "messages":
        messages = check_messages(value, "messages")
        if isinstance(messages, str):
            return messages
        text = chat_template(spec).render(messages)
        if isinstance(text, str):
            return text
        return Prompt(text[0], special=False), own
    if isinstance(value, str):
        return Prompt(value, special=spec.data.text.add_special_tokens), own
    value = _as_list(value)
    if isinstance(value, (list, tuple)) and not value:
        return "prompt: an empty list of token ids; give at least one"
    if isinstance(value, (list, tuple)) and all(_is_id(t) for t in value):
        if any(not 0 <= t < vocab for t in value):
            return f"token ids outside the model's vocabulary of {vocab}"
        return [int(t) for t in value], own
    if isinstance(value, (list, tuple)):  # the item that is no token id, by its place
        at = next(i for i, t in enumerate(value) if not _is_id(t))
        return (f"prompt: expected a string or a list of token ids, got {shown(value[at])} "
                f"at place {at} in the list")
    return f"prompt: expected a string or a list of token ids, got {shown(value)}"
