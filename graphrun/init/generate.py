"""`graphrun init --hf DIR --task generate`: a generation spec for a causal LM. The prompts'
field, grouping by length, the batch and prompt (seq) buckets planned for the batches the run
forms from the prompts' token lengths (plan/generation.py: prefill and decode graphs counted,
at most GRAPHS), within the model's positions less the new tokens, and the generate section;
inputs and outputs are implied, so the model is not built."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphrun.base.errors import InputError, ModelError
from graphrun.init.render import GROUP_WINDOW
from graphrun.init.text import SEQ_MULTIPLE, TEXT_NAMES, plan_grouped
from graphrun.spec.generate import CAUSAL_LM_SUFFIXES

NEW_TOKENS = 128  # generate.max_new_tokens of a written generation spec
# Alpaca's `instruction` is the prompt and its `input` an optional context, often blank
PROMPT_NAMES = ("prompt", "prompts", "instruction", "question", "input", "query", *TEXT_NAMES)


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


@dataclass(frozen=True)
class Generation:
    """init's generation options: --max-new-tokens and the sampling ones."""

    max_new_tokens: int | None = None  # None: not given (NEW_TOKENS, or the records' own)
    temperature: float | None = None  # None or 0: greedy
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None

    @property
    def given(self) -> bool:
        """Any option besides the defaults: the user asked for a generation job."""
        return self != Generation()

    def sampling(self) -> dict:
        """generate.sampling: greedy, or sample with the options given."""
        extra = {k: v for k, v in (("top_p", self.top_p), ("top_k", self.top_k),
                                   ("seed", self.seed)) if v is not None}
        if not self.temperature:
            if extra:
                raise ModelError(f"--{next(iter(extra)).replace('_', '-')} samples: give "
                                 "--temperature above 0 too (0 or none: greedy)")
            return {"method": "greedy"}
        return {"method": "sample", "temperature": self.temperature, **extra}


def plan_generate(found, texts: list[str], tokenizer, limit: int, eos: list[int],
                  options: Generation = Generation(), special: bool = True) -> None:
    """found (init_hf.HfInferred) as a generation job: grouped batches, their batch and prompt
    buckets within the positions that a prompt and its new tokens share, the graphs they make
    (found.graphs), and the generate section. special: the texts get the tokenizer's special
    tokens (false: rendered chats hold theirs)."""
    from graphrun.plan.generation import (GRAPHS, graphs_of, plan_generation,
                                          prefill_evaluation)
    from graphrun.spec.generate import GenerateSpec

    new = options.max_new_tokens or NEW_TOKENS
    room = limit - new
    if room < SEQ_MULTIPLE:
        raise ModelError(f"--hf: the model holds {limit} positions, too few for a prompt and "
                         f"{new} new tokens (generate.max_new_tokens): lower --max-new-tokens")
    written = GenerateSpec(max_new_tokens=new)  # what the spec's slots and prefill take

    def planner(hist):
        return plan_generation(hist, GRAPHS, written, {"seq": SEQ_MULTIPLE})[0]

    def evaluator(hist, lists):
        return prefill_evaluation(hist, lists, written)[0]

    batches = plan_grouped(found, texts, tokenizer, room // SEQ_MULTIPLE * SEQ_MULTIPLE,
                           window_most=GROUP_WINDOW, slack=slack(found.batch_size),
                           planner=planner, evaluator=evaluator, special=special)
    found.graphs = graphs_of(found.buckets, new, batches)
    found.generate = {"max_new_tokens": new, "sampling": options.sampling(),
                      "stop": {"eos": "auto"}}
    found.eos_ids, found.positions = eos, limit
    found.truncate = False  # a longer prompt is rejected with its line, as the run's default


@dataclass
class RecordParams:
    """The records' own generation parameters, as init plans them: generate.per_record, the
    job's cap on new tokens that covers the records' own, the output format that writes
    their samples (n), and "where: why" for each sampled record the run rejects for one."""

    fields: dict[str, str]  # parameter -> record field
    max_new_tokens: int
    notes: list[str] = field(default_factory=list)  # fields named as parameters, not read
    output_format: str = "jsonl"
    rejected: list[str] = field(default_factory=list)


def parameter_fields(profile, taken: set) -> tuple[dict[str, str], list[str]]:
    """parameter -> the record field named for it (read/requests.named_as_parameters) where
    most of the values it holds are ones the run takes for that parameter; and a note for
    each field so named that is not (a field of booleans named logprobs is no count of
    alternatives)."""
    from graphrun.init.sample import MAJORITY
    from graphrun.read.requests import named_as_parameters, params_from_fields

    out, notes = {}, []
    for param, names in named_as_parameters(set(profile.values) - taken).items():
        for name in names:
            given = [v for v in profile.values[name] if v is not None]
            why = [w for w in (params_from_fields({name: v}, {param: name}, from_spec=False)
                               for v in given) if isinstance(w, str)]
            if given and len(given) - len(why) >= MAJORITY * len(given):
                out[param] = name
                break
            if why:
                notes.append(f"field {name!r} is not read as each record's {param} "
                             f"(generate.per_record): {len(why)} of the {len(given)} values "
                             f"sampled are none, e.g. {why[0]}")
    return out, notes


def record_params(profile, fields: dict[str, str], notes: list[str], options: Generation,
                  limit: int, bad: set[str], batch: bool = False) -> RecordParams:
    """The records' own parameters checked record by record as the run checks them: fields
    (parameter_fields), or with batch each Batch request's line (bad: the places of records
    already rejected for their prompt). The cap on new tokens rises to the records' largest
    where --max-new-tokens was not given and the model's positions leave half of them to the
    prompt; a record asking for n > 1 samples makes the output openai_batch, whose lines hold
    a prompt's choices."""
    from graphrun.read.openai_batch import read_request
    from graphrun.read.requests import params_from_fields, unserved
    from graphrun.spec.endpoints import file_endpoint
    from graphrun.spec.generate import GenerateSpec

    endpoint = file_endpoint(profile.path) if batch else None

    def read(record: dict):  # the record's parameters, or why the run refuses them
        if not batch:
            return params_from_fields(record, fields)
        request = read_request(record, endpoint)
        return request if isinstance(request, str) else request.params

    checked = [(w, read(r)) for w, r in zip(profile.wheres, profile.rows) if w not in bad]
    good = [p for _, p in checked if not isinstance(p, str)]
    asked = max((p.max_new_tokens or 0 for p in good), default=0)
    cap = options.max_new_tokens or max(NEW_TOKENS, asked if asked <= limit // 2 else 0)
    many = batch or any((p.n or 1) > 1 for p in good)
    found = RecordParams(fields, cap, notes, "openai_batch" if many else "jsonl")
    g = GenerateSpec(max_new_tokens=cap, sampling=options.sampling())
    for where, params in checked:
        why = params if isinstance(params, str) else unserved(params, g, found.output_format)
        if why:
            found.rejected.append(f"{where}: {why}")
    return found


BATCH_KEYS = {"custom_id", "method", "url", "body"}


ID_NAMES = ("input_ids", "prompt_ids", "token_ids", "tokens", "ids", *PROMPT_NAMES)


def prompt_source(profile, text_field: str | None) -> tuple[str, str | None]:
    """How the sampled records hold their prompts: ("batch", None) for OpenAI Batch request
    lines, ("chat", field) for chat messages, ("ids", field) for token ids where no field holds
    text or none named as a prompt does, ("text", None) for a text field."""
    fields = set(profile.texts) | set(profile.objects) | {profile.id_field}
    bodies = profile.objects.get("body") or profile.texts.get("body") or []
    if BATCH_KEYS <= fields and 2 * sum(isinstance(b, dict) for b in bodies) > len(bodies):
        return "batch", None  # most bodies objects: a few others are the run's error lines
    # a field most of whose records hold messages: a few that do not are bad records
    chats = [n for n, values in {**profile.texts, **profile.objects}.items()
             if 2 * sum(map(_messages, values)) > len(values)]
    ids = profile.token_ids
    if text_field is not None:
        if text_field in chats:
            return "chat", text_field
        return ("ids", text_field) if text_field in ids else ("text", None)
    if chats:
        return "chat", "messages" if "messages" in chats else chats[0]
    named = [n for n in ID_NAMES if n in ids]
    # a text field named as a prompt is the prompt; else token ids named as one are (a string
    # field beside them, a language or a source, is no prompt)
    if ids and (not profile.texts
                or (named and not any(n in profile.texts for n in PROMPT_NAMES))):
        if named or len(ids) == 1:
            return "ids", named[0] if named else next(iter(ids))
        raise InputError(f"holds several fields of whole numbers ({', '.join(ids)}) and none "
                         f"is named {' or '.join(ID_NAMES[:2])}: pass --text-field for the one "
                         "holding the prompts' token ids", where=str(profile.path))
    return "text", None


def _messages(value) -> bool:
    """Whether a record's value is a list of messages (objects with a role), good or bad."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and "role" in m for m in value))


def rendered_prompts(profile, source: tuple[str, str | None], tokenizer
                     ) -> tuple[list[str], bool, list[str], list[str]]:
    """The sampled prompts as the run tokenizes them, whether the tokenizer adds its special
    tokens to them, "where: why" for each sampled chat the run would reject, and where each
    prompt is: chats rendered by the tokenizer's chat template (it adds none), a Batch file's
    completions prompts as they are (it does). One the run would reject is left out."""
    from graphrun.read.chat import check_messages
    from graphrun.read.openai_batch import one_prompt
    from graphrun.read.prompts import given_ids
    from graphrun.read.text import record_problem
    from graphrun.spec.endpoints import CHAT, file_endpoint
    from graphrun.spec.rules import no_chat_template

    kind, field = source
    texts, chats, rejected, wheres_of = [], [], [], {"texts": [], "chats": []}
    wheres = profile.wheres or [f"record {i + 1}" for i in range(len(profile.rows))]
    if kind == "batch":
        # the file's endpoint decides, as in the run; record_params names a request it refuses
        endpoint = file_endpoint(profile.path)
        chat, key = endpoint == CHAT, "messages" if endpoint == CHAT else "prompt"
        items = [(where, b.get("messages"), one_prompt(b.get("prompt")), chat)
                 for where, r in zip(wheres, profile.rows)
                 if isinstance(b := r.get("body"), dict) and key in b
                 and r.get("url") == endpoint]
        named = "body.messages"
    else:
        items = []
        for where, row in zip(wheres, profile.rows):
            why = record_problem(row, [field], profile.id_field)  # no such field, a bad id
            if why:
                rejected.append(f"{where}: {why}")
            else:  # a null one is checked as the run checks it
                items.append((where, row.get(field), None, True))
        named = field
    for where, messages, prompt, chat in items:
        if chat:  # a chat request or record: the run checks its messages
            checked = check_messages(messages, named)
            if not isinstance(checked, str):
                chats.append(checked)
                wheres_of["chats"].append(where)
            else:
                rejected.append(f"{where}: {checked}")
        elif isinstance(prompt, str):
            texts.append(prompt)
            wheres_of["texts"].append(where)
        elif isinstance(prompt, list) and not isinstance(given_ids(prompt, ""), str):
            texts.append(np.asarray(prompt, np.int64))  # token ids: counted as they are
            wheres_of["texts"].append(where)
    if chats and not tokenizer.chat_template:
        raise InputError(no_chat_template(tokenizer.name_or_path), where=str(profile.path))
    if chats:  # a Batch file has one endpoint: chats, or completions prompts
        texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                 for c in chats]
    if not texts:
        raise InputError("no record of the sample holds a prompt graphrun can read"
                         + (f"; the first: {rejected[0]}" if rejected else ""),
                         where=str(profile.path))
    return texts, not chats, rejected, wheres_of["chats" if chats else "texts"]


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
    sampling = found.generate.get("sampling", {})
    how = ("greedy" if sampling.get("method", "greedy") == "greedy" else
           f"sampled at temperature {sampling.get('temperature')}")
    if not found.eos_ids:
        return (f"generate: the model names no EOS id (generation_config.json, config.json), "
                f"so every prompt gets {new} new tokens; add stop.token_ids to stop earlier")
    return (f"generate: {how}, up to {new} new tokens, stopping at the model's EOS "
            f"{found.eos_ids} (stop.eos: auto); the longest prompt bucket + {new} stays within "
            f"the model's {found.positions} positions")
