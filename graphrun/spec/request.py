"""One record's own generation parameters (a per-record field, an OpenAI Batch request's body),
read by read/ and honoured per row by the generation engine (generate/). None: the spec's value.

Typed once here, below both, so that what a record asks for reaches the row that serves it
unchanged; a value the engine cannot serve is refused for that record when it is read, never
dropped.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    n: int = 1  # samples of this prompt
    logprobs: int | None = None  # top alternatives per generated token; None: no logprobs

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_PARAMS


DEFAULT_PARAMS = RequestParams()
