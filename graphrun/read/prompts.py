"""What each record asks the model, as data.text tokenizes it: a text field (or a pair), chat
messages rendered by the model's chat template (data.chat), or an OpenAI Batch request
(data.format openai_batch); with the record's own generation parameters (generate.per_record,
a request's body), checked against what the engine serves. A generation job's prompt field (or
a completions request's prompt) may hold token ids instead of text: taken as they are.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace
from typing import Callable

from graphrun.read.chat import chat_template, check_messages
from graphrun.read.openai_batch import read_request
from graphrun.spec.endpoints import file_endpoint
from graphrun.read.requests import named_as_parameters, params_from_fields, shown, unserved
from graphrun.spec.keys import PipelineSpec
from graphrun.spec.request import DEFAULT_PARAMS, RequestParams


@dataclass(frozen=True)
class Prompt:
    text: str | tuple[str, str]  # a text, or a pair's two ("" where ids are given)
    special: bool  # the tokenizer adds its special tokens; false: the text holds them
    params: RequestParams = DEFAULT_PARAMS
    ids: tuple[int, ...] | None = None  # token ids given for it: no tokenizer runs on them


class Prompts:
    """One spec's way from a record (a JSONL object, a Parquet row as a dict) to its Prompt."""

    def __init__(self, spec: PipelineSpec):
        self.spec, self.text = spec, spec.data.text
        self.per_record = spec.generate.per_record.fields if spec.generate else {}
        self.batch = spec.data.format == "openai_batch"
        self.endpoint = file_endpoint(spec.data.path) if self.batch else None
        self._chat = None

    @property
    def carries_params(self) -> bool:
        """Records carry parameters of their own (the batch's fields get REQUEST_FIELD)."""
        return self.batch or bool(self.per_record)

    @property
    def fields(self) -> list[str]:
        """The record fields read: the text's (or messages', or a request line's) and the
        per-record parameters'."""
        if self.batch:
            return ["method", "url", "body"]
        return list(dict.fromkeys([*self.text.fields, *self.per_record.values()]))

    def chat(self):
        if self._chat is None:
            self._chat = chat_template(self.spec)
        return self._chat

    def of(self, record: dict) -> Prompt | str:
        """The record's prompt, or why it is rejected."""
        if self.batch:
            return self._request(record)
        if self.spec.data.chat is not None:
            name = self.text.fields[0]
            messages = check_messages(record[name], name)
            if isinstance(messages, str):
                return messages
            text = self.chat().render(messages)
            if isinstance(text, str):
                return text
            prompt = Prompt(text[0], special=False)
        else:
            values = [record[name] for name in self.text.fields]
            if self.spec.generate is not None and isinstance(values[0], list):
                name = self.text.fields[0]
                if values[0] and all(isinstance(m, dict) and "role" in m for m in values[0]):
                    return (f"{name}: holds chat messages, not a prompt's text or token ids: "
                            f"read it with data.chat: {{field: {name}}} in place of data.text")
                prompt = given_ids(values[0], name)
                if isinstance(prompt, str):
                    return prompt
            else:
                for name, v in zip(self.text.fields, values):
                    if not isinstance(v, str):
                        return f"{name}: expected a string, got {kind(v)}"
                prompt = Prompt(values[0] if len(values) == 1 else tuple(values),
                                special=self.text.add_special_tokens)
        if not self.per_record:
            return prompt
        params = params_from_fields(record, self.per_record)
        if isinstance(params, str):
            return params
        return self._served(replace(prompt, params=params))

    def _request(self, line: dict) -> Prompt | str:
        request = read_request(line, self.endpoint)
        if isinstance(request, str):
            return request
        if request.chat:
            messages = check_messages(request.body["messages"], "body.messages")
            if isinstance(messages, str):
                return messages
            text = self.chat().render(messages)
            if isinstance(text, str):
                return text
            prompt = Prompt(text[0], special=False, params=request.params)
        elif isinstance(request.body["prompt"], list):
            prompt = given_ids(request.body["prompt"], "body.prompt")
            if isinstance(prompt, str):
                return prompt
            prompt = replace(prompt, params=request.params)
        else:
            prompt = Prompt(request.body["prompt"], special=self.text.add_special_tokens,
                            params=request.params)
        return self._served(prompt)

    def _served(self, prompt: Prompt) -> Prompt | str:
        g, output = self.spec.generate, self.spec.output.format
        return unserved(prompt.params, g, output) or prompt


def given_ids(value: list, named: str) -> Prompt | str:
    """A prompt given as token ids (whole numbers >= 0; the model's vocabulary is checked where
    it is known, read/text.tokenize), or why not."""
    if not value:
        return f"{named}: an empty list of token ids; give at least one"
    at = next((i for i, t in enumerate(value) if type(t) is not int or t < 0), None)
    if at is not None:  # found by place: a null item is itself None
        return (f"{named}: expected a string or a list of token ids (whole numbers >= 0), "
                f"got {shown(value[at])} at place {at} in the list")
    return Prompt("", special=False, ids=tuple(value))


def kind(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    return {dict: "an object", list: "an array", str: "a string"}.get(type(value), "a number")


def parameter_warnings(spec: PipelineSpec, fields: Callable[[], list[str]]) -> list[str]:
    """Warnings about the records' own parameters, for what the run would otherwise pass
    over without a word: a field generate.per_record maps that none of the first records
    holds (a typo gives every record the spec's value), and fields named as generation
    parameters that per_record does not map. fields(): the first records' field names, read
    only for a job that takes parameters from its records (not an OpenAI Batch file, whose
    requests hold their own); none where they cannot be read."""
    g = spec.generate
    if g is None or spec.data.format == "openai_batch" or spec.data.text is None:
        return []
    names = fields()
    if not names:
        return []
    out = []
    mapped = g.per_record.fields
    for param, name in mapped.items():
        if name not in names:
            near = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
            out.append(f"warning: generate.per_record.{param} reads field {name!r}, which "
                       "none of the first records holds, so they get the spec's value"
                       + (f"; they hold {near[0]!r}, which may be it" if near else ""))
    read = {*spec.data.text.fields, *mapped.values(), spec.data.id_field}
    unread = {param: found[0] for param, found in named_as_parameters(set(names) - read).items()
              if param not in mapped}
    if unread:
        pairs = ", ".join(f"{param}: {name}" for param, name in unread.items())
        out.append(f"warning: the records hold {', '.join(map(repr, unread.values()))}, named "
                   "as generation parameters that the spec does not read: every record gets "
                   "the spec's value. To apply each record's own, add to the spec's generate "
                   f"section per_record: {{{pairs}}}")
    return out
