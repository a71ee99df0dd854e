"""A generation job's records as read/ and write/ see them: the prompt's token ids in (from
data.text), the completion's fields out (GENERATION.md). The user's spec gives neither."""

from __future__ import annotations

from graphrun.spec.generate import PROMPT_AXIS
from graphrun.spec.keys import InputSpec, OutputSpec

IMPLIED_INPUTS = {"input_ids": {"shape": ["batch", PROMPT_AXIS], "dtype": "int64"}}
IMPLIED_OUTPUTS = {"token_ids": {"shape": ["batch", "new_tokens"], "dtype": "int64"},
                   "text": {"shape": ["batch"]}, "finish_reason": {"shape": ["batch"]},
                   "prompt_tokens": {"shape": ["batch"], "dtype": "int64"},
                   "output_tokens": {"shape": ["batch"], "dtype": "int64"}}
# where log-probabilities are asked for: per new token its logprob and text, and its top
# alternatives' ids, logprobs and texts (empty lists for a record that asks none)
LOGPROB_OUTPUTS = {"logprobs": {"shape": ["batch", "new_tokens"], "dtype": "float32"},
                   "tokens": {"shape": ["batch", "new_tokens"]},
                   "top_token_ids": {"shape": ["batch", "new_tokens", "top"], "dtype": "int64"},
                   "top_logprobs": {"shape": ["batch", "new_tokens", "top"], "dtype": "float32"},
                   "top_tokens": {"shape": ["batch", "new_tokens", "top"]}}


PROMPT_LOGPROB_OUTPUTS = {"prompt_logprobs": {"shape": ["batch", PROMPT_AXIS],
                                              "dtype": "float32"}}


def logprobs_asked(spec) -> bool:
    """Whether a generation spec's records may carry log-probabilities: generate.logprobs,
    a per-record logprobs field, or an OpenAI Batch file (whose requests may ask)."""
    g = spec.generate
    return g is not None and (g.logprobs is not None or g.per_record.logprobs is not None
                              or spec.data.format == "openai_batch")


# output.format openai_batch's too: per record, its n samples' completions (a line's choices)
SAMPLES_OUTPUT = "samples"


def with_implied_io(spec):
    """The spec with a generation job's implied inputs and outputs filled in, for the steps
    that read and write records (the user's spec, as run.json and the manifest record it,
    keeps them out)."""
    if spec.generate is None:
        return spec
    inputs = {n: InputSpec(**v) for n, v in IMPLIED_INPUTS.items()}
    implied = {**IMPLIED_OUTPUTS, **(LOGPROB_OUTPUTS if logprobs_asked(spec) else {}),
               **(PROMPT_LOGPROB_OUTPUTS if spec.generate.prompt_logprobs else {})}
    outputs = {n: OutputSpec(**v) for n, v in implied.items()}
    if spec.output.format == "openai_batch":
        outputs[SAMPLES_OUTPUT] = OutputSpec(shape=["batch"])
    return spec.model_copy(update={"inputs": inputs, "outputs": outputs})  # keeps its source
