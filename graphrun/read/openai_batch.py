"""OpenAI Batch API request lines (data.format: openai_batch): {custom_id, method, url, body}.
A chat request's body holds messages, a completions request's a prompt; the rest of the body
is its parameters, each checked: a bad value, or a key graphrun does not serve at a value other
than its default, rejects the request with why (it gets an error line), never dropped.

OpenAI's Batch API takes one endpoint per file; so does graphrun: the file's endpoint is its
first served request's url (spec/endpoints.py), and the output's lines (chat.completion or
text_completion) follow it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from graphrun.read.requests import CHECKS, number_in, shown, stop_strings, whole
from graphrun.spec.endpoints import CHAT, COMPLETIONS, ENDPOINTS
from graphrun.spec.generate import MAX_LOGPROBS
from graphrun.spec.request import DEFAULT_PARAMS, RequestParams

LINE_KEYS = {"custom_id", "method", "url", "body"}
# body keys accepted at their default values only (what a client library often sends):
# key -> the values that mean "not asked for"
AT_DEFAULT = {
    "stream": (False, None), "echo": (False, None),
    "best_of": (1, None), "suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None,), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "stream_options": (None,), "modalities": (None,),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
}
# body keys that ask nothing of the generation (kept for the response or ignored by OpenAI too)
INERT = {"model", "user", "metadata", "store", "service_tier", "parallel_tool_calls"}


@dataclass(frozen=True)
class Request:
    """One request line, checked."""

    url: str
    body: dict
    params: RequestParams

    @property
    def chat(self) -> bool:
        return self.url == CHAT


def read_request(line, endpoint: str | None) -> Request | str:
    """A parsed line -> the Request, or why it cannot be served. endpoint: the file's."""
    if not isinstance(line, dict):
        return "the line is not a JSON object {custom_id, method, url, body}"
    missing = sorted(LINE_KEYS - line.keys())
    if missing:
        return f"missing {', '.join(missing)} (a request line has custom_id, method, url, body)"
    extra = sorted(line.keys() - LINE_KEYS)
    if extra:
        return f"unknown key {extra[0]!r} in the request line (custom_id, method, url, body)"
    if line["method"] != "POST":
        return f"method {line['method']!r}: Batch requests are POST"
    url, body = line["url"], line["body"]
    if url not in ENDPOINTS:
        return f"url {url!r} is not served: give {CHAT} or {COMPLETIONS}"
    if endpoint is not None and url != endpoint:
        return (f"url {url}: this file's requests go to {endpoint} (its first request's), "
                f"and a Batch file has one endpoint: put the {url} requests in a file of "
                "their own")
    if not isinstance(body, dict):
        return "body is not a JSON object"
    params = body_params(body, url == CHAT)
    if isinstance(params, str):
        return params
    if url == COMPLETIONS:  # the reader and init take the one prompt as it stands
        body = {**body, "prompt": one_prompt(body["prompt"])}
    return Request(url, body, params)


def one_prompt(prompt):
    """A completions prompt given as OpenAI's list of one prompt (["text"], [[ids]]) -> that
    prompt; any other value as it is."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt[0]
    return prompt


def body_params(body: dict, chat: bool) -> RequestParams | str:
    """The body's parameters as RequestParams, or why not (bad value, unknown key)."""
    prompt_key = "messages" if chat else "prompt"
    if prompt_key not in body:
        return f"body has no {prompt_key!r} (a {'chat' if chat else 'completions'} request's)"
    prompt = one_prompt(body.get("prompt"))
    if not chat and prompt == []:
        return "body.prompt: an empty list; give a string or a list of token ids"
    if not chat and not (isinstance(prompt, str) or isinstance(prompt, list)
                         and all(type(t) is int for t in prompt)):
        return ("body.prompt: give one string or one list of token ids per request (a list of "
                "several prompts is not served)")
    given: dict = {}
    known = {prompt_key, "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
             "stop_token_ids", "n", "logprobs", "top_logprobs", "presence_penalty",
             "frequency_penalty", "repetition_penalty",
             *(["max_completion_tokens"] if chat else [])}
    for key, v in body.items():
        if key in INERT or key in known:
            continue
        if key in AT_DEFAULT:
            if v not in AT_DEFAULT[key]:
                return (f"body.{key} {json.dumps(v)} is not served by this graphrun yet "
                        "(only its default): remove it")
            continue
        return f"body.{key} is not a parameter graphrun serves: remove it"
    most = [body.get(k) for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    if len(most) == 2 and most[0] != most[1]:
        return "body: max_tokens and max_completion_tokens differ: give one"
    if most:
        got = whole("body.max_tokens", most[0], 1)
        if isinstance(got, str):
            return got
        given["max_new_tokens"] = got
    if body.get("top_k") == -1:
        body = {**body, "top_k": None}  # vLLM's "all tokens", the default
    if body.get("temperature") is not None:  # OpenAI's range, narrower than a spec's
        got = number_in("body.temperature", body["temperature"], 0, 2)
        if isinstance(got, str):
            return got
        given["temperature"] = got
    for key in ("top_p", "top_k", "min_p", "seed", "n", "presence_penalty", "frequency_penalty",
                "repetition_penalty"):
        if body.get(key) is not None:
            check, attr = CHECKS[key]
            got = check(f"body.{key}", body[key])
            if isinstance(got, str):
                return got
            given[attr] = got
    ids = body.get("stop_token_ids")  # vLLM's: more ids that end the completion
    if ids is not None:
        if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
            return f"body.stop_token_ids: {ids!r} is not a list of token ids"
        given["stop_token_ids"] = tuple(ids)
    if body.get("stop") is not None:
        got = stop_strings("body.stop", body["stop"])
        if isinstance(got, str):
            return got
        given["stop_strings"] = got
    logprobs = _logprobs(body, chat)
    if isinstance(logprobs, str):
        return logprobs
    if logprobs is not None:
        given["logprobs"] = logprobs
    return replace(DEFAULT_PARAMS, **given)


def _logprobs(body: dict, chat: bool) -> int | None | str:
    """Top alternatives per token: chat's logprobs (bool) + top_logprobs (0-20), completions'
    logprobs (0-5); None: none asked for."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if not chat:
        if top is not None:
            return "body.top_logprobs is a chat request's key: a completions request gives logprobs"
        if lp is not None and (type(lp) is not int or not 0 <= lp <= 5):
            return (f"body.logprobs: {shown(lp)} is not a whole number in [0, 5] (a completions "
                    "request's logprobs counts the alternatives per token)")
        return lp
    if lp is not None and not isinstance(lp, bool):
        return f"body.logprobs: {shown(lp)} is not true or false"
    if top is not None and (type(top) is not int or not 0 <= top <= MAX_LOGPROBS):
        return f"body.top_logprobs: {shown(top)} is not a whole number in [0, {MAX_LOGPROBS}]"
    if top is not None and not lp:
        return "body.top_logprobs needs logprobs: true"
    return (top or 0) if lp else None


