"""What a generation job asks for (Sampling, GenerateConfig), what a batch gives back
(Completion), and the one error a user can cause here (GenerationError).

Plain frozen dataclasses: the spec (the pipeline's `generate:` section) is the source of truth
for defaults a user sees; these carry its values into the generator, checked once by
`check_config` so that no step inside a graph meets a value it cannot handle.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphrun.base.errors import GenerationError
from graphrun.spec.generate import MAX_LOGPROBS

SAMPLING_METHODS = ("greedy", "sample")


@dataclass(frozen=True)
class Sampling:
    method: str = "greedy"  # "greedy" | "sample"
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int = 0
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off; the penalties apply to greedy rows too
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty, self.presence_penalty,
                self.frequency_penalty) != (1.0, 0.0, 0.0)


@dataclass(frozen=True)
class GenerateConfig:
    max_new_tokens: int
    min_new_tokens: int = 0
    sampling: Sampling = Sampling()
    eos_ids: tuple[int, ...] = ()  # stop ids: the model's EOS plus extra stop ids
    pad_id: int = 0
    logprobs: int | None = None  # top alternatives per new token (0-20); None: no logprobs
    prompt_logprobs: bool = False  # each prompt token's logprob (after the first)

    stop_strings: tuple[str, ...] = ()  # the text ends before the first of these
    n: int = 1  # samples of a prompt that asks for none of its own


@dataclass
class Completion:
    token_ids: list[int]  # new tokens, the EOS included when it stopped there
    finish_reason: str  # "eos" | "stop" (a stop string) | "length"
    prompt_tokens: int
    output_tokens: int
    # per new token where the record asked (else None): the model's log-probability of it,
    # and of its top alternatives (ids, best first) [new tokens][k]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    prompt_logprobs: list[float] | None = None  # the prompt's tokens after the first, where asked
    text: str | None = None  # a stop string's: the text before it (else the caller decodes)
    sample: int = 0  # which of the prompt's n samples


def check_config(config: GenerateConfig, vocab: int) -> None:
    """Every problem with the settings at once, before any buffer is made."""
    s, problems = config.sampling, []
    if config.max_new_tokens < 1:
        problems.append(f"max_new_tokens is {config.max_new_tokens}: give at least 1")
    if not 0 <= config.min_new_tokens <= config.max_new_tokens:
        problems.append(f"min_new_tokens is {config.min_new_tokens}: give 0 to max_new_tokens "
                        f"({config.max_new_tokens})")
    if s.method not in SAMPLING_METHODS:
        problems.append(f"sampling.method is {s.method!r}: give one of {SAMPLING_METHODS}")
    if s.method == "sample" and not s.temperature > 0:
        problems.append(f"sampling.temperature is {s.temperature}: give a value > 0 "
                        "(method greedy for temperature 0)")
    if s.top_k < 0:
        problems.append(f"sampling.top_k is {s.top_k}: give 0 (off) or more")
    if not 0 < s.top_p <= 1:
        problems.append(f"sampling.top_p is {s.top_p}: give a value in (0, 1]")
    if not 0 <= s.min_p <= 1:
        problems.append(f"sampling.min_p is {s.min_p}: give a value in [0, 1]")
    if not s.repetition_penalty > 0:
        problems.append(f"sampling.repetition_penalty is {s.repetition_penalty}: give a value "
                        "> 0 (1: off)")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(s, name) <= 2:
            problems.append(f"sampling.{name} is {getattr(s, name)}: give a value in [-2, 2]")
    if config.logprobs is not None and not 0 <= config.logprobs <= MAX_LOGPROBS:
        problems.append(f"logprobs is {config.logprobs}: give 0 to {MAX_LOGPROBS} (top "
                        "alternatives per token), or null for none")
    bad = [t for t in (*config.eos_ids, config.pad_id) if not 0 <= t < vocab]
    if bad:
        problems.append(f"token ids {bad} (eos_ids / pad_id) are outside the model's "
                        f"vocabulary of {vocab}")
    if not all(isinstance(t, str) and t for t in config.stop_strings):
        problems.append(f"stop strings {list(config.stop_strings)}: give non-empty strings")
    if config.n < 1:
        problems.append(f"n is {config.n}: give 1 or more samples per prompt")
    if problems:
        raise GenerationError("generate: " + "; ".join(problems))
