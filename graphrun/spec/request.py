"""One record's own generation parameters (a per-record field, an OpenAI Batch request's body),
read by read/ and honoured per row by the generation engine (generate/). None: the spec's value.

Typed once here, below both, so that what a record asks for reaches the row that serves it
unchanged; a value the engine cannot serve is refused for that record when it is read, never
dropped.

How it travels: read/ puts one RequestParams per record in the record batch's fields under
REQUEST_FIELD (an object array [n], DEFAULT_PARAMS where the record asks nothing of its own),
present only where the spec lets records carry parameters (data.format openai_batch,
generate.per_record). It is sliced, sorted and split with the record's other fields, so the
engine's stage(fields, n, lengths, slot, ids) finds fields[REQUEST_FIELD][i] beside
fields["input_ids"][i].
"""

from __future__ import annotations

from dataclasses import dataclass, fields

REQUEST_FIELD = "request_params"


EXTRA_STOPS = 8  # stop ids a record may add to the spec's (the engine's per-row buffer)


@dataclass(frozen=True)
class RequestParams:
    max_new_tokens: int | None = None
    temperature: float | None = None  # 0: greedy, as OpenAI and vLLM read it
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # added to the spec's stop ids
    stop_strings: tuple[str, ...] = ()
    n: int | None = None  # samples of this prompt
    logprobs: int | None = None  # top alternatives per generated token; None: no logprobs
    repetition_penalty: float | None = None  # vLLM's: over prompt and output tokens
    presence_penalty: float | None = None  # OpenAI's and vLLM's: over output tokens
    frequency_penalty: float | None = None

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_PARAMS

    def given(self) -> dict[str, object]:
        """The parameters this record sets, by name (those that differ from the defaults)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(DEFAULT_PARAMS, f.name)}


DEFAULT_PARAMS = RequestParams()
