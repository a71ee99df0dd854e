"""`graphrun init --hf DIR --task generate`: a generation spec for a causal LM. The prompts'
field, grouping by length, the batch and prompt (seq) buckets planned for the batches the run
forms from the prompts' token lengths (plan/generation.py: prefill and decode graphs counted,
at most GRAPHS), within the model's positions less the new tokens, and the generate section;
inputs and outputs are implied, so the model is not built."""

from __future__ import annotations

from graphrun.base.errors import ModelError
from graphrun.init.render import GROUP_WINDOW
from graphrun.init.text import SEQ_MULTIPLE, TEXT_NAMES, plan_grouped
from graphrun.spec.generate import CAUSAL_LM_SUFFIXES

NEW_TOKENS = 128  # generate.max_new_tokens of a written generation spec
PROMPT_NAMES = ("prompt", "prompts", "input", "question", "instruction", "query", *TEXT_NAMES)


def causal_arch(config) -> str:
    """The architecture of config.json that makes it a causal LM, or one clear error."""
    archs = list(getattr(config, "architectures", None) or [])
    causal = [a for a in archs if a.endswith(CAUSAL_LM_SUFFIXES)]
    if getattr(config, "is_encoder_decoder", False) or not causal:
        named = ", ".join(archs) if archs else f"no architecture ({config.model_type})"
        raise ModelError(f"--task generate: config.json names {named}, which is no causal "
                         "language model (a class ending in ForCausalLM or LMHeadModel); give "
                         "the folder of a causal LM, or leave out --task for what this model "
                         "computes")
    return causal[0]


def plan_generate(found, texts: list[str], tokenizer, limit: int,
                  eos: list[int]) -> None:
    """found (init_hf.HfInferred) as a generation job: grouped batches, their batch and prompt
    buckets within the positions that a prompt and its new tokens share, the graphs they make
    (found.graphs), and the generate section."""
    from graphrun.plan.generation import GRAPHS, graphs_of, plan_generation

    room = limit - NEW_TOKENS
    if room < SEQ_MULTIPLE:
        raise ModelError(f"--hf: the model holds {limit} positions, too few for a prompt and "
                         f"{NEW_TOKENS} new tokens (generate.max_new_tokens); init writes "
                         "generation specs for models of more positions")

    def planner(hist):
        return plan_generation(hist, GRAPHS, NEW_TOKENS, {"seq": SEQ_MULTIPLE})[0]

    batches = plan_grouped(found, texts, tokenizer, room // SEQ_MULTIPLE * SEQ_MULTIPLE,
                           window_most=GROUP_WINDOW, slack=slack(found.batch_size),
                           planner=planner)
    found.graphs = graphs_of(found.buckets, NEW_TOKENS, batches)
    found.generate = {"max_new_tokens": NEW_TOKENS, "sampling": {"method": "greedy"},
                      "stop": {"eos": "auto"}}
    found.eos_ids, found.positions = eos, limit


def slack(batch_size: int) -> int:
    """Records past its own that a planned batch's prompt bucket covers: a record the run
    rejects and the sample did not (or the other way) moves every later cut of its window by
    one."""
    return max(1, batch_size // 16)


def eos_ids(transformers, where: str, config) -> list[int]:
    """What stop.eos: auto stops at: generation_config.json's eos_token_id, else config.json's."""
    eos = None
    try:
        eos = transformers.GenerationConfig.from_pretrained(where, local_files_only=True
                                                            ).eos_token_id
    except Exception:  # noqa: BLE001 - no generation_config.json: config.json's is next
        pass
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def stop_check(found) -> str:
    """What init prints to check about a generation spec's stopping (found: HfInferred)."""
    new = found.generate["max_new_tokens"]
    if not found.eos_ids:
        return (f"generate: the model names no EOS id (generation_config.json, config.json), "
                f"so every prompt gets {new} new tokens; add stop.token_ids to stop earlier")
    return (f"generate: greedy, up to {new} new tokens, stopping at the model's EOS "
            f"{found.eos_ids} (stop.eos: auto); the longest prompt bucket + {new} stays within "
            f"the model's {found.positions} positions")
