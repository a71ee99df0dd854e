"""The spec's generate: section: a generation job over a causal LM (docs/generation.md
describes the keys). Rules tying it to the rest of the spec are rules._generate's."""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import ConfigDict, Field, model_validator

from graphrun.spec.base import Size, Strict, Text, Whole

PROMPT_AXIS = "seq"  # the bucket axis of prompt lengths (prefill)
GENERATE_MAX_GRAPHS = 40  # buckets_max_graphs of a generation spec: prefill and decode graphs
# The transformers classes that generate: their names end so (AutoModelForCausalLM,
# LlamaForCausalLM, GPT2LMHeadModel, ...).
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")

GENERATE_DOC = (
    "Make this a generation job over a causal LM (model.hf of a causal-LM class, or builtin "
    "llama): data.text's prompts (or data.chat's messages, or an OpenAI Batch file's "
    "requests) in, one completion per record out (id, token_ids, text, finish_reason, "
    "prompt_tokens, output_tokens); buckets batch (decode rows) and seq (prompt lengths, "
    "packed into prefills). null: one forward pass per record, unless data.chat or "
    "data.format openai_batch implies this section with its defaults.")
# The pipeline schema says what rules._sections says: inputs and outputs are required
# without generate:, and refused with it.
# data.chat and data.format imply generate: (PipelineSpec._implied), and a generation spec
# plans its buckets when it gives none.
IMPLIED_SECTIONS_SCHEMA = {
    "if": {"anyOf": [
        {"properties": {"generate": {"type": "object"}}, "required": ["generate"]},
        {"properties": {"data": {"anyOf": [
            {"properties": {"chat": {"type": "object"}}, "required": ["chat"]},
            {"properties": {"format": {"const": "openai_batch"}}, "required": ["format"]}]}}}]},
    "then": {"not": {"anyOf": [{"required": ["inputs"]}, {"required": ["outputs"]}]}},
    "else": {"required": ["inputs", "outputs", "buckets"]}}
SAMPLE_DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 0}
MAX_LOGPROBS = 20  # top alternatives per token at most, as OpenAI's top_logprobs


class SamplingSpec(Strict):
    """How each new token is picked from the model's logits."""

    # the editor's schema says what _greedy_alone says: greedy keeps the sampling defaults
    model_config = ConfigDict(extra="forbid", validate_default=True, json_schema_extra={
        "if": {"properties": {"method": {"const": "sample"}}, "required": ["method"]},
        "else": {"properties": {k: {"const": v} for k, v in SAMPLE_DEFAULTS.items()}}})

    method: Literal["greedy", "sample"] = Field(
        "greedy", description="greedy: the most likely token (as HF generate(do_sample=False)); "
        "sample: drawn from softmax(logits / temperature) after min_p, top_k and top_p, each "
        "record's draws depending only on (seed, record id, position). The penalties apply to "
        "both.")
    temperature: float = Field(SAMPLE_DEFAULTS["temperature"], ge=0, description="sample: "
                               "divides the logits; below 1 sharpens, above 1 flattens; 0: "
                               "greedy (as OpenAI and vLLM read it).")
    top_k: Whole = Field(SAMPLE_DEFAULTS["top_k"], ge=0, description="sample: keep the k most "
                       "likely tokens; 0: all.")
    top_p: float = Field(SAMPLE_DEFAULTS["top_p"], gt=0, le=1, description="sample: keep the "
                         "smallest set of most likely tokens whose probabilities add up to at "
                         "least top_p; 1: all.")
    min_p: float = Field(SAMPLE_DEFAULTS["min_p"], ge=0, le=1, description="sample: keep the "
                         "tokens at least min_p times as likely as the most likely one; 0: all.")
    seed: Whole = Field(SAMPLE_DEFAULTS["seed"], description="sample: the seed of every record's "
                      "random stream.")
    repetition_penalty: float = Field(
        1.0, gt=0, description="vLLM's: the logit of a token in the record's prompt or "
        "completion so far is divided by this where positive, multiplied where negative; 1: "
        "off.")
    presence_penalty: float = Field(
        0.0, ge=-2, le=2, description="OpenAI's and vLLM's: subtracted once from the logit of "
        "each token already in the completion; 0: off.")
    frequency_penalty: float = Field(
        0.0, ge=-2, le=2, description="OpenAI's and vLLM's: subtracted from the logit of each "
        "token times its count in the completion so far; 0: off.")

    @model_validator(mode="after")
    def _zero_is_greedy(self) -> "SamplingSpec":
        # temperature 0 means the most likely token, whatever top_k, top_p and seed say
        if self.temperature == 0:
            for k, v in SAMPLE_DEFAULTS.items():
                setattr(self, k, v)
            self.method = "greedy"
        return self

    @model_validator(mode="after")
    def _greedy_alone(self) -> "SamplingSpec":
        # greedy ignores these keys: a value that would change sampling, silently dropped,
        # hides a forgotten `method: sample` (the defaults, as a dumped spec holds, are fine)
        given = [f"{k} {_number(getattr(self, k))}" for k, v in SAMPLE_DEFAULTS.items()
                 if getattr(self, k) != v]
        if self.method == "greedy" and given:
            raise ValueError(
                f"{', '.join(given)} given with method greedy, which always takes the most "
                "likely token: set method: sample to sample with them, or remove them")
        return self


def _number(value) -> str:
    """An int exactly (a seed of 2**70 is not 1.18059e+21), a float shortly."""
    return str(value) if isinstance(value, int) else f"{value:g}"


class StopSpec(Strict):
    """When a record's generation stops, besides generate.max_new_tokens."""

    eos: Literal["auto", "none"] = Field(
        "auto", description="auto: at the model's end-of-sequence ids (its generation_config's "
        "eos_token_id, else its config's); none: only at token_ids and max_new_tokens.")
    token_ids: list[Annotated[int, Field(strict=True, ge=0)]] = Field(
        default_factory=list, description="More token ids that end a record (included in its "
        "output, as EOS is).")
    strings: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list, description="Strings that end a record when its text holds one "
        "(finish_reason stop): its text ends before the string; its token_ids keep the tokens "
        "up to and including the one that completed it. A record's own (per_record stop, an "
        "OpenAI Batch request's stop) are added to these.")


class PerRecordSpec(Strict):
    """Record fields that set a record's own generation parameters (generate.per_record); an
    absent or null field: the spec's value. Each value is checked per record: a bad one
    rejects that record with its line and why."""

    max_new_tokens: Optional[Text] = Field(None, description="Field of a whole number >= 1.")
    temperature: Optional[Text] = Field(None, description="Field of a number >= 0 (0: greedy).")
    top_p: Optional[Text] = Field(None, description="Field of a number in (0, 1].")
    top_k: Optional[Text] = Field(None, description="Field of a whole number >= 0 (0: all).")
    min_p: Optional[Text] = Field(None, description="Field of a number in [0, 1].")
    seed: Optional[Text] = Field(None, description="Field of a whole number.")
    stop: Optional[Text] = Field(None, description="Field of a string or a list of strings that "
                                 "end the completion (the text ends before it).")
    n: Optional[Text] = Field(None, description="Field of a whole number >= 1: samples of the "
                              "prompt.")
    repetition_penalty: Optional[Text] = Field(None, description="Field of a number > 0 (1: "
                                               "off).")
    presence_penalty: Optional[Text] = Field(None, description="Field of a number in [-2, 2].")
    frequency_penalty: Optional[Text] = Field(None, description="Field of a number in [-2, 2].")
    logprobs: Optional[Text] = Field(None, description="Field of a whole number in [0, 20]: "
                                     "the record's log-probabilities with that many top "
                                     "alternatives per token (at most generate.logprobs, or 20 "
                                     "where that is null).")

    @property
    def fields(self) -> dict[str, str]:
        """parameter -> the record field that sets it."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class GenerateSpec(Strict):
    """A generation job: prompts (data.text) in, completions out, through a continuous-batching
    engine: decode slots refilled as records finish, the KV cache in blocks. inputs and outputs
    are implied. buckets.batch: the decode graphs' row counts (the largest is the slots, unless
    slots is given); buckets.seq: the packed prefill's token counts (the largest is the longest
    prompt)."""

    max_new_tokens: Size = Field(128, description="New tokens per record at most "
                                 "(finish_reason length when reached).")
    min_new_tokens: Whole = Field(0, ge=0, description="New tokens per record at least: the stop "
                                "ids are not picked before this many (at most max_new_tokens).")
    n: Size = Field(1, description="Samples per prompt (a record's own n, per_record or an "
                    "OpenAI Batch request's, replaces it): each its own seeded stream, sample 0 "
                    "the one a job of n 1 draws. More than 1 is written by output.format "
                    "openai_batch (choices, index 0 to n-1).")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    stop: StopSpec = Field(default_factory=StopSpec)
    logprobs: Optional[int] = Field(
        None, ge=0, le=MAX_LOGPROBS, strict=True, description="Write each new token's "
        "log-probability (logprobs) and its k most likely alternatives (top_logprobs: ids, "
        "logprobs, text), k 0 to 20: the model's own log_softmax of its logits, before "
        "penalties, temperature and filters (as OpenAI and vLLM report them). null: none.")
    prompt_logprobs: bool = Field(
        False, strict=True, description="Write each prompt token's log-probability given the "
        "tokens before it (prompt_logprobs: one per prompt token after the first), the "
        "scoring use; the prefill then computes the logits of every prompt token.")
    per_record: PerRecordSpec = Field(
        default_factory=PerRecordSpec, description="Record fields that set each record's own "
        "parameters (JSONL or Parquet records), e.g. {max_new_tokens: max_tokens, "
        "temperature: temperature}.")

    slots: Union[Size, Literal["auto"], None] = Field(
        None, description="Records decoding at once (decode slots); a finished record's slot "
        "takes the next prompt at once. null: the largest buckets.batch; auto: on a GPU as many "
        "as half the memory left after the weights holds at their longest (at most 256, a "
        "multiple of 8), on the CPU the largest buckets.batch.")
    kv_block_size: Size = Field(16, description="Tokens per KV cache block: a record holds "
                                "blocks for its actual length, freed when it finishes.")
    kv_blocks: Optional[Size] = Field(
        None, description="Blocks in the KV cache's pool (one more is the trash block padding "
        "writes to). null: enough for every slot's longest record (longest prompt + "
        "max_new_tokens); fewer admit prompts only as blocks free up.")
    prefill_tokens: Optional[Size] = Field(
        None, description="Prompt tokens packed into one prefill at most (powers of two from "
        "the largest buckets.seq up to it are captured too). null: the largest buckets.seq.")
    prefix_cache: bool = Field(
        True, description="Compute a prompt's leading full KV blocks once: a later prompt that "
        "starts with the same tokens (a system prompt, few-shot examples) shares those blocks "
        "and prefills only the rest; blocks no record holds stay cached until the pool needs "
        "room. The manifest counts prompt tokens computed and reused. false: every prompt "
        "prefilled whole.")
