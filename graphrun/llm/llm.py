"""graphrun.LLM: generation in-process, as vLLM's LLM.generate and LLM.chat: prompts in,
completions back in the caller's order, on the same continuous-batching engine a generation
job runs (generate/runner.py's GenerationRunner builds it from the spec), without the job's
reader, stream, journal or output files.

The engine is built once per LLM (model, KV cache, graphs) and serves every call; the function
forms graphrun.generate and graphrun.chat build one for the call and close it.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path

from graphrun.base.errors import GraphrunError, InputError, Problem, SpecError
from graphrun.generate.config import GenerationError
from graphrun.generate.engine import Request
from graphrun.generate.records import with_implied_io
from graphrun.generate.runner import GenerationRunner
from graphrun.llm.asked import NOT_IN_PROCESS, PARAMS, Asked, ask, call_params
from graphrun.plan.auto import resolve_auto
from graphrun.spec.keys import PipelineSpec
from graphrun.spec.load import Positions, load_spec, override_list, spec_from_data

FOLDER_MAX_NEW_TOKENS = 256  # a model folder's default cap on new tokens (sizes the KV cache)
FOLDER_MAX_PROMPT = 2048  # ... and on prompt tokens, within the model's position table
FOLDER_ROWS = [1, 4, 16, 64]  # ... and its decode row counts (the largest: the slots)
# every parameter a prompt may carry is served on its row: sampled beside greedy, cut by
# top_k / top_p (generate/runner.py per_row_choices)
EVERY_PARAM = {"sample": True, "filtered": True}


@dataclass(frozen=True)
class GenerateOutput:
    """One prompt's completion, as a generation job writes its record."""

    id: object  # the prompt's `id`, else its place in the list
    text: str  # the new tokens decoded, special tokens skipped
    token_ids: list[int]  # the new tokens, the stop token included where it stopped there
    finish_reason: str  # "eos" (a stop id) | "stop" (a stop string) | "length" (max_new_tokens)
    prompt_tokens: int
    output_tokens: int


class LLM:
    """A generation spec's engine, in-process.

    model_or_spec: a PipelineSpec with generate:, a spec file's path, or a Hugging Face causal
    LM's folder (then max_new_tokens, max_prompt_tokens, dtype and device size the engine; a
    spec sets them itself). overrides: `key.path=value` strings for a spec file, as --set.
    """

    def __init__(self, model_or_spec, *, overrides=(), max_new_tokens: int | None = None,
                 max_prompt_tokens: int | None = None, dtype: str = "float32",
                 device: str = "auto", log=None, **unknown):
        if unknown:  # a sampling parameter given here (vLLM's habit) was Python's TypeError
            name = sorted(unknown)[0]
            said = (f"{name} is a parameter of each call: llm.generate(prompts, {name}=...)"
                    if name in PARAMS else
                    f"{NOT_IN_PROCESS[name]} is served by `graphrun run` (a spec's generate: "
                    "section), not yet in process" if name in NOT_IN_PROCESS else
                    f"unknown keyword {name!r}: LLM() takes overrides, max_new_tokens, "
                    "max_prompt_tokens, dtype, device and log")
            raise _refused("LLM", said)
        spec = _spec(model_or_spec, override_list(overrides), max_new_tokens,
                     max_prompt_tokens, dtype, device)
        spec, _ = resolve_auto(with_implied_io(spec))  # buckets: auto, planned as the job does
        self.spec = spec
        self._too_long = _too_long_advice(model_or_spec, spec)
        self.runner = GenerationRunner(spec, log=log, choices=EVERY_PARAM)
        self.engine = self.runner.engine
        self._decode = self.runner.text_decoder()
        self._closed = False
        self._lock = threading.Lock()  # one call at a time: the engine's slots and cache are shared

    def generate(self, prompts, **params) -> list[GenerateOutput]:
        """Completions of prompts (strings, token id lists, or dicts with `prompt`, `messages`,
        `id` and their own parameters), in their order. params: max_new_tokens, temperature (0:
        greedy), top_p, top_k, seed, stop_token_ids for every prompt; unset: the spec's.
        Calls from several threads are served one after another."""
        with self._lock:
            self._check_open()
            return self._run(ask(self.spec, prompts, call_params(params),
                                 self.engine.model.vocab, too_long=self._too_long))

    def chat(self, conversations, **params) -> list[GenerateOutput]:
        """Completions of conversations (each a list of OpenAI messages, or a dict with
        `messages`, `id` and its own parameters), rendered by the model's chat template with
        the generation prompt, in their order. A dict with `prompt` is refused: generate()
        serves plain prompts."""
        with self._lock:
            self._check_open()
            return self._run(ask(self.spec, conversations, call_params(params),
                                 self.engine.model.vocab, chat=True, too_long=self._too_long))

    def _run(self, asked: Asked) -> list[GenerateOutput]:
        problems = []
        for i, (prompt, rid, own) in enumerate(zip(asked.prompts, asked.record_ids,
                                                  asked.params)):
            try:
                self.engine.check(Request(prompt, rid, own))
            except GenerationError as err:
                problems.append(f"[{i}] {err}")
        if problems:
            raise InputError("; ".join(problems[:5]), where=f"generate: {len(problems)} of "
                             f"{len(asked.prompts)} prompts")
        with self.runner.device_context():
            done = self.engine.generate(asked.prompts, asked.record_ids, asked.params)
        # at a stop string the engine gives the text before it, as the job writes it
        return [GenerateOutput(id=rid, token_ids=list(c.token_ids),
                               text=self._decode(c.token_ids) if c.text is None else c.text,
                               finish_reason=c.finish_reason, prompt_tokens=c.prompt_tokens,
                               output_tokens=c.output_tokens)
                for rid, c in zip(asked.record_ids, done)]

    def _check_open(self) -> None:
        if self._closed:
            raise GraphrunError("this graphrun.LLM is closed (close() was called, or its with "
                                "block ended): build a new LLM to generate again")

    def close(self) -> None:
        """The engine's memory given back (after a call in flight ends); a second close does
        nothing."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self.runner.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


BUILD_KEYS = ("overrides", "max_prompt_tokens", "dtype", "device", "log")  # LLM()'s own


def generate(model_or_spec, prompts, **params) -> list[GenerateOutput]:
    """LLM(model_or_spec, ...).generate(prompts, ...), the engine closed after: params holds
    both LLM()'s keywords (BUILD_KEYS) and generate()'s; a folder's engine is sized for the
    call's max_new_tokens."""
    with _llm_for_call(model_or_spec, params) as llm:
        return llm.generate(prompts, **params)


def chat(model_or_spec, conversations, **params) -> list[GenerateOutput]:
    """LLM(model_or_spec, ...).chat(conversations, ...), the engine closed after (params as
    generate's)."""
    with _llm_for_call(model_or_spec, params) as llm:
        return llm.chat(conversations, **params)


def _llm_for_call(model_or_spec, params: dict) -> "LLM":
    """The LLM of one call: BUILD_KEYS taken out of params for its constructor."""
    build = {k: params.pop(k) for k in BUILD_KEYS if k in params}
    if "max_new_tokens" in params and isinstance(model_or_spec, (str, Path)) \
            and Path(model_or_spec).is_dir():
        build["max_new_tokens"] = params["max_new_tokens"]  # the engine made for this call
    return LLM(model_or_spec, **build)


def _spec(given, overrides: list[str], max_new_tokens, max_prompt_tokens, dtype,
          device) -> PipelineSpec:
    sized = {"max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens}
    if isinstance(given, PipelineSpec) or (Path(given).is_file() if isinstance(given, (str, Path))
                                           else False):
        set_here = sorted(k for k, v in sized.items() if v is not None)
        if set_here:
            raise _refused("generate", f"{set_here[0]} sizes a model folder's engine; a "
                                "spec sets it in its generate: and buckets: sections")
        if isinstance(given, PipelineSpec) and overrides:  # they were dropped unsaid
            raise _refused("generate", "overrides apply to a spec file's YAML, as --set: pass "
                                "the file's path, or change the PipelineSpec's fields")
        spec = given if isinstance(given, PipelineSpec) else load_spec(given, overrides)
        if spec.generate is None:
            raise _refused(str(spec.source_path or "spec"),
                                "this spec has no generate: section (nor data.chat, nor an "
                                "OpenAI Batch file): graphrun.Runner(spec) runs its model")
        return spec
    if not isinstance(given, (str, Path)) or not Path(given).is_dir():
        raise _refused("generate", f"{given!r} is neither a spec (a PipelineSpec or a "
                            ".yaml file) nor a model folder")
    if overrides:  # a folder's spec is made here, from the arguments: they were dropped unsaid
        raise _refused(str(given), "overrides apply to a spec file, as --set; a model folder's "
                       "engine takes max_new_tokens, max_prompt_tokens, dtype and device")
    for name, value in sized.items():  # 0 is a value given, not "the default"
        if value is not None and (isinstance(value, bool) or not isinstance(value, Integral)
                                  or value < 1):
            raise _refused(str(given), f"{name}: {value!r} is not a whole number >= 1")
    return folder_spec(Path(given), FOLDER_MAX_NEW_TOKENS if max_new_tokens is None
                       else int(max_new_tokens), max_prompt_tokens and int(max_prompt_tokens),
                       dtype, device)


def folder_spec(folder: Path, max_new_tokens: int, max_prompt_tokens: int | None, dtype: str,
                device: str) -> PipelineSpec:
    """A generation spec for a causal LM's folder: greedy, the model's EOS, prompts up to
    max_prompt_tokens (else the model's position table less max_new_tokens, at most
    FOLDER_MAX_PROMPT), refused past it rather than cut."""
    positions = _positions(folder)
    longest = max_prompt_tokens or min(FOLDER_MAX_PROMPT, positions - max_new_tokens)
    if longest < 1:
        raise _refused(str(folder), f"max_new_tokens {max_new_tokens} leaves no room for a "
                            f"prompt in the model's position table of {positions}: pass "
                            f"max_new_tokens below {positions}")
    seq, n = [], 16
    while n < longest:
        seq.append(n)
        n *= 2
    data = {"version": 1, "name": folder.name or "model", "device": device,
            "model": {"hf": {"path": str(folder.resolve()), "class": "AutoModelForCausalLM"},
                      "dtype": dtype},
            # the engine reads no file: data names a prompt field for the tokenizer's settings
            "data": {"path": "prompts.jsonl", "text": {"field": "prompt", "truncate": False}},
            "generate": {"max_new_tokens": max_new_tokens},
            "buckets": {"batch": FOLDER_ROWS, "seq": [*seq, longest]},
            "output": {"dir": "unused"}}
    try:
        return spec_from_data(data, Positions(str(folder)), Path.cwd())
    except SpecError as err:  # every rule checked; the absent prompts file is no problem here
        kept = [p for p in err.problems if p.path != "data.path"]
        if kept:
            raise SpecError(kept) from None
    return _unchecked_data_path(data)


def _unchecked_data_path(data: dict) -> PipelineSpec:
    """The spec whose only problem is its data file's absence (the engine reads none)."""
    from graphrun.spec.rules import resolve_paths

    return resolve_paths(PipelineSpec.model_validate(data), Path.cwd())


def _too_long_advice(given, spec: PipelineSpec) -> str | None:
    """What a reason for a prompt past a folder's LLM's longest says to do (its constructor's
    arguments, not spec keys); None for a spec, whose keys the default names."""
    if isinstance(given, PipelineSpec) or not Path(given).is_dir():
        return None
    from graphrun.models.hf import tokenizer_folder
    from graphrun.read.text import max_length

    new = spec.generate.max_new_tokens
    most = _positions(Path(given)) - new
    if max_length(spec, tokenizer_folder(spec)) >= most:  # already all the positions allow
        return (f"(this LLM's longest prompt: the model's {most + new} positions less "
                f"max_new_tokens {new}): shorten the prompt, or build the LLM with a smaller "
                "max_new_tokens to leave a prompt more of them")
    return (f"(this LLM's longest prompt): build it with LLM(folder, max_prompt_tokens=N), N "
            f"up to {most} (the model's positions less max_new_tokens), or shorten the prompt")


def _positions(folder: Path) -> int:
    """The model's position table (config.json's max_position_embeddings, else n_positions)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    for key in ("max_position_embeddings", "n_positions"):
        if isinstance(config.get(key), int):
            return config[key]
    return FOLDER_MAX_PROMPT + FOLDER_MAX_NEW_TOKENS


def _refused(where: str, message: str) -> SpecError:
    return SpecError([Problem(where, "", message)])
