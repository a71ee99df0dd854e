"""What a generation job asks for (Sampling, GenerateConfig), what a batch gives back
(Completion, BatchResult), and the one error a user can cause here (GenerationError).

Plain frozen dataclasses: the spec (the pipeline's `generate:` section) is the source of truth
for defaults a user sees; these carry its values into the generator, checked once by
`check_config` so that no step inside a graph meets a value it cannot handle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from graphrun.base.errors import ModelError

SAMPLING_METHODS = ("greedy", "sample")


class GenerationError(ModelError):
    """The model, its buckets or the generation settings cannot generate as asked: the
    message names what (the class, the bucket, the value) and what to do."""


@dataclass(frozen=True)
class Sampling:
    method: str = "greedy"  # "greedy" | "sample"
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int = 0


@dataclass(frozen=True)
class GenerateConfig:
    max_new_tokens: int
    min_new_tokens: int = 0
    sampling: Sampling = Sampling()
    eos_ids: tuple[int, ...] = ()  # stop ids: the model's EOS plus extra stop ids
    pad_id: int = 0


@dataclass
class Completion:
    token_ids: list[int]  # new tokens, the EOS included when it stopped there
    finish_reason: str  # "eos" | "length"
    prompt_tokens: int
    output_tokens: int


@dataclass
class BatchResult:
    completions: list[Completion]  # in the order of the prompts given
    prefill_s: float  # device time (CUDA events on a GPU, host clock on the CPU)
    decode_s: float
    # from the generate call to the batch's first tokens, less the setup of graphs the batch
    # was the first to need (their time is their capture_s)
    ttft_s: float
    decode_steps: int  # decode steps run, each over the whole padded batch
    # decode row-steps that produced a token a record needed: per real row its output tokens
    # less the one prefill produced; decode_steps * bucket rows - useful_steps is the waste
    useful_steps: int
    bucket: tuple  # (batch rows, prompt length) of the prefill graph used
    kv_buckets: tuple = ()  # the KV lengths of the decode graphs used, in order of use
    rows: int = 0  # batch rows of the graphs used (bucket[0])
    finish_counts: dict = field(default_factory=dict)  # finish_reason -> records
    # decode steps launched after the device had finished every step before them (it idled
    # until the host's launch); None off a GPU, where the host runs the steps itself
    host_bound_steps: int | None = None


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
    bad = [t for t in (*config.eos_ids, config.pad_id) if not 0 <= t < vocab]
    if bad:
        problems.append(f"token ids {bad} (eos_ids / pad_id) are outside the model's "
                        f"vocabulary of {vocab}")
    if problems:
        raise GenerationError("generate: " + "; ".join(problems))
