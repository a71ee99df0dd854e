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
# output.format openai_batch's too: per record, its n samples' completions (a line's choices)
SAMPLES_OUTPUT = "samples"


def with_implied_io(spec):
    """The spec with a generation job's implied inputs and outputs filled in, for the steps
    that read and write records (the user's spec, as run.json and the manifest record it,
    keeps them out)."""
    if spec.generate is None:
        return spec
    inputs = {n: InputSpec(**v) for n, v in IMPLIED_INPUTS.items()}
    outputs = {n: OutputSpec(**v) for n, v in IMPLIED_OUTPUTS.items()}
    if spec.output.format == "openai_batch":
        outputs[SAMPLES_OUTPUT] = OutputSpec(shape=["batch"])
    return spec.model_copy(update={"inputs": inputs, "outputs": outputs})  # keeps its source
