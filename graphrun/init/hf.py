"""`graphrun init --hf DIR`: a spec for a Hugging Face model folder (or a hub cache entry) over a
file of text.

config.json -> the task and its Auto class (an encoder: a mean-pooled, L2-normalised embedding;
a causal LM: the next token's top k; a sequence classifier: its logits, softmax and argmax;
of one text or, for a pair of fields such as query and passage, of the pair) -> the model's
tokenizer -> the inputs it gives that the model takes -> grouping by length on (a window sized
to the file) and the batch and seq buckets planned for the batches it forms from the sample's
token lengths, never past the model's limit -> the model built as `run` builds it and called
once on two tokenized records (output names and sizes) -> the spec, commented, validated,
written.

With --task generate (a causal LM only): the prompts' field, grouping by length, the batch and
seq (prompt) buckets planned for the batches it forms, their prefill and decode graphs counted
(plan/generation.py), within the model's limit less the new tokens, and a generate: section;
inputs and outputs are implied, so the model is not built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from graphrun.base.errors import GraphrunError, InputError, ModelError, first_line
from graphrun.init.infer import MAX_LISTED, Inferred, sample_notes, spec_out_dir, spec_target
from graphrun.init.sample import FieldInfo, sample_data
from graphrun.init.generate import (NEW_TOKENS, PROMPT_NAMES, Generation, RecordParams,
                                    causal_arch, eos_ids, parameter_fields, plan_generate,
                                    prompt_source, record_params, rendered_prompts, stop_check)
from graphrun.init.render import relative_to_spec, render_generate_spec, render_hf_spec, write_spec_files
from graphrun.init.text import (TEXT_NAMES, chosen_fields, non_texts, plan_grouped,
                                repeated_ids, texts_of)
from graphrun.spec.keys import BATCH
from graphrun.spec.paths import model_vocab

TOPK = 5  # next tokens written per record
# auto: from config.json's architectures (embed, classify; a causal LM asks which of the others)
TASKS = ("auto", "generate", "next-token")
PROBE_TEXTS = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
WHAT = "graphrun init --hf"


@dataclass(frozen=True)
class Task:
    kind: str  # embed | next-token | classify
    auto_class: str
    why: str


@dataclass
class HfInferred(Inferred):
    """Inferred, plus what only a text model has: the outputs' heads and the text field."""

    task: Task | None = None
    heads: dict[str, dict] = field(default_factory=dict)  # output name -> its spec entry
    text_field: str | list[str] = "text"  # a pair's two fields for a cross-encoder
    limit: int = 512  # tokens per record at most: the model's
    lengths: tuple[int, int] = (0, 0)  # the sample's shortest and longest text, in tokens
    truncate: bool = True  # data.text.truncate: cut longer texts, else reject them
    generate: dict | None = None  # the spec's generate section (--task generate)
    eos_ids: list[int] = field(default_factory=list)  # what stop.eos: auto stops at
    positions: int = 0  # the model's positions, which a prompt and its new tokens share
    window: int | None = None  # data.group_by_length: records per window sorted by length
    padding: tuple[float, float] | None = None  # token padding expected: file order, grouped
    graphs: object = None  # --task generate: plan/generation.py's GenerationGraphs of the lists
    # where the prompts are: ("text", None), ("chat", messages field), ("batch", None)
    source: tuple = ("text", None)
    outliers: list[tuple[str, int]] = field(default_factory=list)  # (where, tokens) planned without
    max_length: int | None = None  # data.text.max_length: where the outliers are cut
    params: RecordParams | None = None  # --task generate: the records' own parameters
    # where each planned prompt is (file:line) when they are no field's texts (chat, Batch)
    prompt_wheres: list[str] | None = None


def init_hf(*, hf: str, data: str | Path, spec_path: str | Path = "pipeline.yaml",
            out_dir: str | Path | None = None, name: str | None = None, batch_size: int = 32,
            sample: int = 10000, id_field: str | None = None, dtype: str = "float32",
            force: bool = False, task: str = "auto",
            text_field: str | None = None,
            generation: Generation = Generation()) -> HfInferred:
    """Infer a spec for the model in `hf` over the text in `data`, write it to `spec_path`
    with pipeline.schema.json beside it, and return what was inferred. task: auto (from
    config.json) or generate (a generation job over a causal LM). text_field: --text-field,
    one name or two joined by a comma (a pair); default: guessed by name. generation: a
    generation job's --max-new-tokens and sampling options. A causal LM with task auto asks
    for --task, unless the records are chats or Batch requests, or generation options are
    given: then it is a generation job."""
    from graphrun.spec.paths import PKG, package_form
    from graphrun.models.hf import refuse_remote_code, require

    if task not in TASKS:
        raise GraphrunError(f"--task {task!r}: use one of {', '.join(TASKS)}")
    spec_path = spec_target(spec_path, force)
    transformers = require("transformers", WHAT)
    require("tokenizers", WHAT)
    where = _model_location(hf)
    refuse_remote_code(where if Path(where).is_dir() else None, f"--hf {hf!r}",
                       "write the spec by hand with model.hf.trust_remote_code: true")
    config = _config(transformers, hf, where)
    tokenizer = _tokenizer(transformers, hf, where)
    profile = sample_data(Path(data).resolve(), sample, id_field, text=True)
    source = prompt_source(profile, text_field)
    # fields named as generation parameters (max_tokens, temperature) say a generation job too
    asks = bool(parameter_fields(profile, {text_field, profile.id_field})[0])
    kind = chosen_task(config, task, source[0] != "text" or generation.given or asks)
    found = HfInferred(name=name or _default_name(hf, kind), profile=profile,
                       model={"hf": {"path": where, "class": kind.auto_class}, "dtype": dtype},
                       batch_size=batch_size, task=kind)
    found.source = source
    if source[0] != "text":
        if source[0] == "ids" and kind.kind not in ("generate", "next-token"):
            # no causal LM: --task generate would be refused too
            raise GraphrunError(f"{profile.path.name} holds no text field: field "
                                f"{source[1]!r} holds prompts of token ids, which only a "
                                f"generation job over a causal LM reads; --hf's {kind.kind} "
                                "tokenizes a text field: give a file whose records hold the "
                                "text as a string")
        if kind.kind != "generate":
            held = {"chat": "chat messages", "batch": "Batch requests",
                    "ids": f"prompts of token ids (field {source[1]!r})"}[source[0]]
            raise GraphrunError(f"{profile.path.name} holds {held}, which a generation job "
                                "reads: use --task generate")
        found.text_field = source[1] or "body"
        if source[0] == "ids":  # taken as they are: no special tokens added
            texts, special = texts_of(profile, found.text_field, ids=True), False
            profile.skipped = sorted(profile.skipped + non_texts(
                profile, found.text_field, True, model_vocab(Path(where))), key=_line)
        else:
            texts, special, rejected, found.prompt_wheres = rendered_prompts(
                profile, source, tokenizer)
            profile.skipped = sorted(profile.skipped + rejected, key=_line)
    else:
        found.text_field = chosen_fields(profile, text_field, kind.kind == "classify",
                                         PROMPT_NAMES if kind.kind == "generate" else TEXT_NAMES)
        if kind.kind == "generate" and not isinstance(found.text_field, str):
            raise GraphrunError("--text-field: a generation job reads one prompt field, not "
                                "a pair")
        texts, special = texts_of(profile, found.text_field, kind.kind == "generate"), True
        generate = kind.kind == "generate"
        profile.skipped = sorted(profile.skipped + non_texts(
            profile, found.text_field, generate, model_vocab(Path(where)) if generate else None),
            key=_line)  # run rejects them too (or reads token ids): name them, in file order
    limit = model_limit(tokenizer, config, where)
    if kind.kind == "generate":
        batch = source[0] == "batch"
        fields, notes = ({}, []) if batch else parameter_fields(
            profile, {found.text_field, profile.id_field})
        if fields or notes or batch:  # the run rejects what it cannot serve: name it now
            found.params = record_params(profile, fields, notes, generation, limit,
                                         _places(profile.skipped), batch)
            generation = replace(generation, max_new_tokens=found.params.max_new_tokens)
            profile.skipped = sorted(profile.skipped + found.params.rejected, key=_line)
        plan_generate(found, texts, tokenizer, limit, eos_ids(transformers, where, config),
                      generation, special)
    else:
        _plan_inputs_and_outputs(found, texts, tokenizer, limit, config)
    profile.skipped = sorted(profile.skipped + repeated_ids(profile, _places(profile.skipped)),
                             key=_line)
    if profile.wheres and set(profile.wheres) <= _places(profile.skipped):
        # a spec planned from records the run would all refuse was written, and exit 0
        raise InputError(f"no record of the sample could be used ({len(profile.wheres)} read); "
                         f"the first: {profile.skipped[0]}", where=str(profile.path))
    found.checks = _checks(found, config)
    spec_dir = spec_path.parent
    if hf.startswith(PKG):  # stays valid wherever the package is installed
        found.model["hf"]["path"] = hf
    elif Path(where).is_dir() and (packaged := package_form(Path(where))):
        found.model["hf"]["path"] = packaged  # a folder a package ships, named as such
    elif Path(where).is_dir():
        found.model["hf"]["path"] = relative_to_spec(Path(where), spec_dir)
    out = spec_out_dir(spec_path, out_dir)
    render = render_generate_spec if kind.kind == "generate" else render_hf_spec
    found.spec_path, found.schema_path = write_spec_files(
        spec_path, render(found, spec_dir, out))
    return found


def _plan_inputs_and_outputs(found: HfInferred, texts: list[str], tokenizer, limit: int,
                             config) -> None:
    """One forward pass per record: the tokenizer's inputs the model takes, and its outputs'
    heads, shaped by one call of the model."""
    plan_grouped(found, texts, tokenizer, limit)
    names = _input_names(tokenizer, config)
    found.ranges = _ranges(names, config)
    found.heads = _heads(found.task, config)
    model = _build(found, names)
    names = _taken(model, names)
    found.ranges = {n: r for n, r in found.ranges.items() if n in names}
    found.inputs = {n: FieldInfo(n, "int", "int64", ["seq"]) for n in names}
    found.outputs = _probe(model, tokenizer, texts, found)


# ---- the model's files -------------------------------------------------------------------------

def _model_location(hf: str) -> str:
    """A local folder (absolute), pkg://'s folder, or else a hub name for the local cache."""
    from graphrun.spec.paths import resolve_path

    p = Path(hf).expanduser()
    if p.is_dir():
        return str(p.resolve())
    if p.exists() or hf.startswith("."):
        raise ModelError(f"--hf {hf!r}: not a folder; give a folder holding config.json "
                         "(save_pretrained writes one) or a name already in the hub cache")
    return resolve_path(hf, None, "--hf")


def _config(transformers, hf: str, where: str):
    try:
        return transformers.AutoConfig.from_pretrained(where, local_files_only=True,
                                                       trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError: the files say what is missing
        raise ModelError(f"--hf {hf!r}: its config.json could not be read with local files "
                         f"only ({first_line(e)}); give a folder holding config.json and the "
                         "weights, or a name already in the hub cache (nothing is "
                         "downloaded)") from e


def _tokenizer(transformers, hf: str, where: str):
    remedy = ("the text is tokenized with the model's own tokenizer: save it into the folder "
              "(tokenizer.save_pretrained(DIR))")
    # without these files transformers builds an empty tokenizer from the model's type
    if Path(where).is_dir() and not any((Path(where) / f).is_file() for f in TOKENIZER_FILES):
        files = ", ".join(TOKENIZER_FILES[:3])
        raise ModelError(f"--hf {hf!r}: the folder holds no tokenizer ({files}, ...); {remedy}")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(where, local_files_only=True,
                                                         trust_remote_code=False)
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"--hf {hf!r}: no tokenizer could be loaded ({first_line(e)}); "
                         f"{remedy}") from e
    if getattr(tok, "backend_tokenizer", None) is None:
        raise ModelError(f"--hf {hf!r}: its tokenizer ({type(tok).__name__}) is not a fast "
                         "one; graphrun tokenizes with the tokenizers library: save a fast "
                         "tokenizer (tokenizer.json) into the folder")
    return tok


def task_of(config) -> Task:
    """What to compute, from config.json's architectures (the class that saved the weights)."""
    if getattr(config, "is_encoder_decoder", False):
        raise ModelError(f"--hf: {config.model_type} is an encoder-decoder model; init writes "
                         "specs for encoders, causal language models and sequence classifiers")
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch.endswith("ForSequenceClassification"):
            one = int(getattr(config, "num_labels", 2)) < 2
            return Task("classify", "AutoModelForSequenceClassification",
                        f"{arch}: a sequence classifier, " + (
                            "its one logit (a score, as a cross-encoder's)" if one else
                            "its logits, their softmax and argmax"))
        if arch.endswith(("ForCausalLM", "LMHeadModel")):
            return Task("next-token", "AutoModelForCausalLM",
                        f"{arch}: a causal language model, the next token's top {TOPK}")
    named = f"{archs[0]}" if archs else f"no architecture ({config.model_type})"
    return Task("embed", "AutoModel", f"{named}: an encoder, its mean-pooled, L2-normalised "
                "last hidden state as the embedding")


def generate_task(config) -> Task:
    """--task generate: the model must be a causal LM (config.json's architectures say so)."""
    return Task("generate", "AutoModelForCausalLM", f"{causal_arch(config)}: a causal language "
                "model, generating completions of the prompts")


def chosen_task(config, task: str, generating: bool) -> Task:
    """--task's, checked against config.json. A causal LM under auto: a generation job where
    the records or the options say so (generating), else the question which one."""
    if task == "generate":
        return generate_task(config)
    found = task_of(config)
    if task == "next-token" and found.kind != "next-token":
        causal_arch(config)  # one error: no causal LM
    if task == "auto" and found.kind == "next-token":
        if generating:
            return generate_task(config)
        raise GraphrunError(
            f"--hf: {found.why.split(':')[0]} is a causal language model: say what to run "
            "with --task generate (completions of each prompt: text, token ids, finish "
            f"reason; --max-new-tokens, --temperature) or --task next-token (the next "
            f"token's top {TOPK} per record, one forward pass)")
    return found


def model_limit(tokenizer, config, where: str) -> int:
    """Tokens per record at most: the smallest of the tokenizer's model_max_length, the
    model's position table and a sentence-transformers folder's max_seq_length (what its
    encode() cuts at); transformers writes a huge number for "no limit"."""
    import json

    st = Path(where) / "sentence_bert_config.json"
    try:
        st_limit = json.loads(st.read_text()).get("max_seq_length") if st.is_file() else None
    except (OSError, ValueError, AttributeError):
        st_limit = None
    limits = [int(v) for v in (getattr(tokenizer, "model_max_length", None),
                               getattr(config, "max_position_embeddings", None), st_limit)
              if isinstance(v, (int, float)) and 0 < v < 1 << 20]
    return min(limits) if limits else 512


def _input_names(tokenizer, config) -> list[str]:
    """input_ids and attention_mask (pooling needs the mask); token_type_ids where the
    tokenizer gives them and the model has a table for them."""
    names = ["input_ids", "attention_mask"]
    if ("token_type_ids" in getattr(tokenizer, "model_input_names", [])
            and getattr(config, "type_vocab_size", None)):
        names.append("token_type_ids")
    return names


def _ranges(names: list[str], config) -> dict[str, tuple[int, int, str]]:
    ranges = {"input_ids": (0, int(config.vocab_size), "config.json's vocab_size"),
              "attention_mask": (0, 2, "1 real, 0 padding")}
    if "token_type_ids" in names:
        ranges["token_type_ids"] = (0, int(config.type_vocab_size),
                                    "config.json's type_vocab_size")
    return {n: ranges[n] for n in names}


def _heads(task: Task, config) -> dict[str, dict]:
    """The outputs, computed inside the captured step; shapes are filled in by the probe."""
    if task.kind == "embed":
        return {"embedding": {"from": "last_hidden_state",
                              "reduce": ["mean_pool", "l2_normalize"], "dtype": "float32"}}
    if task.kind == "next-token":
        k = min(TOPK, int(config.vocab_size))
        return {"next_ids": {"from": "logits", "reduce": ["last_pool"],
                             "topk": {"k": k, "take": "ids"}},
                "next_probs": {"from": "logits", "reduce": ["last_pool", "softmax"],
                               "topk": {"k": k, "take": "values"}, "dtype": "float32"}}
    logits = {"logits": {"from": "logits", "dtype": "float32"}}
    if int(getattr(config, "num_labels", 2)) < 2:  # one score (a cross-encoder): no classes
        return logits
    return {**logits, "probs": {"from": "logits", "reduce": ["softmax"], "dtype": "float32"},
            "label": {"from": "logits", "reduce": ["argmax"]}}


def _default_name(hf: str, task: Task) -> str:
    from graphrun.spec.paths import PKG

    stem = hf[len(PKG):].partition("/")[0] if hf.startswith(PKG) else Path(hf.rstrip("/")).name
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", stem).strip("-") or "model"
    return f"{stem}-{task.kind}"


# ---- the text ----------------------------------------------------------------------------------

# ---- the model, once -----------------------------------------------------------------------------

def _probe_spec(found: HfInferred, names: list[str]):
    """A spec to build the model from; its output shapes are placeholders (the heads do not
    read them), the probe finds the real ones."""
    from graphrun.spec.keys import PipelineSpec

    inputs = {n: {"shape": [BATCH, "seq"], "dtype": "int64", "range": list(found.ranges[n][:2]),
                  "pad": 0} for n in names}
    outputs = {n: {**h, "shape": [BATCH]} for n, h in found.heads.items()}
    return PipelineSpec.model_validate({
        "version": 1, "name": found.name, "device": "cpu", "model": found.model,
        "inputs": inputs, "outputs": outputs, "buckets": found.buckets,
        "data": {"path": found.profile.path, "batch_size": found.batch_size,
                 "text": {"field": found.text_field}},
        "output": {"dir": "out"}})


def _build(found: HfInferred, names: list[str]):
    import torch

    from graphrun.models.load import build_model

    return build_model(_probe_spec(found, names), torch.device("cpu"), base_dir=Path.cwd())


def _taken(model, names: list[str]) -> list[str]:
    """The inputs the model's forward takes (the heads wrap the Hugging Face model)."""
    import inspect

    inner = getattr(model, "model", model)
    try:
        params = inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return names
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return names
    missing = [n for n in ("input_ids", "attention_mask") if n not in params]
    if missing:
        raise ModelError(f"--hf: the model's forward takes no {' or '.join(missing)}; init "
                         "writes specs for models that take token ids and an attention mask")
    return [n for n in names if n in params]


def _probe(model, tokenizer, texts: list[str], found: HfInferred) -> dict[str, tuple[list, str]]:
    """One call on the first texts, tokenized as `run` tokenizes them: each output's shape
    (batch first, then fixed sizes) and dtype."""
    import torch

    from graphrun.models.call import first_call

    first = texts[:PROBE_TEXTS]
    pair = bool(first) and isinstance(first[0], tuple)
    rows = tokenizer(*([list(c) for c in zip(*first)] if pair else [first]), truncation=True,
                     max_length=found.limit)
    seq = max(len(ids) for ids in rows["input_ids"])
    tensors = {}
    for name in found.inputs:
        values = rows.get(name) or [[0] * len(ids) for ids in rows["input_ids"]]
        padded = [list(v) + [0] * (seq - len(v)) for v in values]
        tensors[name] = torch.tensor(padded, dtype=torch.int64)
    ret = first_call(model, tensors, "keyword", "init's probe (two texts of the file)")
    outputs = {}
    for name in found.heads:
        t = ret[name]
        dims = [BATCH, *[int(d) for d in t.shape[1:]]]
        found.heads[name]["shape"] = dims
        outputs[name] = (dims, str(found.heads[name].get("dtype") or t.dtype).replace(
            "torch.", ""))
    return outputs


# ---- what to check -----------------------------------------------------------------------------

def _checks(found: HfInferred, config) -> list[str]:
    p, task = found.profile, found.task
    lo, hi = found.lengths
    seen = f"in the {p.sampled} records sampled" + (
        f" of {p.records}" if p.records and p.records > p.sampled else "")
    out = [f"model: config.json names {task.why} ({task.auto_class})",
           {"text": f"data.text: field {found.text_field!r}, tokenized by the model's tokenizer",
            "chat": f"data.chat: field {found.text_field!r}, each record's messages rendered by "
                    "the model's chat template, then tokenized",
            "batch": "data.format: openai_batch: each request's messages (chat template) or "
                     "prompt; its parameters checked per request",
            "ids": f"data.text: field {found.text_field!r} holds token ids, taken as they are "
                   "(no special tokens added; the tokenizer turns the completions into text)"
            }[found.source[0]],
           f"buckets.seq {found.buckets['seq']}: token lengths {lo}-{hi} {seen}; "
           + _longer(found)]
    if found.window is not None and found.generate is None:
        before, after = found.padding
        out.append(f"data.group_by_length {found.window}: batches of similar lengths (outputs "
                   f"still in input order); buckets planned for them: {after:.0%} of token "
                   f"positions padding expected ({before:.0%} for batches in file order)")
    if found.generate is not None:
        from graphrun.plan.prefills import ASSUMED

        out.append(f"buckets.seq planned for the prefills, which pack the prompts: "
                   f"{found.padding[1]:.0%} of their positions padding expected (simulated, "
                   f"{ASSUMED}; a run's summary gives the padding it computed)")
        out.append(f"buckets: {found.graphs.text()}, all set up before the first prompt")
        out.append(stop_check(found))
    labels = getattr(config, "id2label", None) or {}
    if task.kind == "classify" and not isinstance(found.text_field, str):
        out.append(f"data.text: a pair, {found.text_field[0]!r} then {found.text_field[1]!r}, "
                   "tokenized together as the tokenizer's text pairs (a cross-encoder)")
    if task.kind == "classify" and labels and len(labels) > 1:
        shown = ", ".join(f"{k}: {v}" for k, v in list(labels.items())[:8])
        out.append(f"outputs.label is the class index; config.json's labels: {shown}")
    if found.params and found.params.fields:
        mapped = ", ".join(f"{f} ({k})" if f != k else f for k, f in found.params.fields.items())
        out.append(f"generate.per_record: each record's own {mapped}; a record without one "
                   "(or null) takes the spec's value"
                   + (f"; max_new_tokens {found.generate['max_new_tokens']} covers the "
                      "records' own" if "max_new_tokens" in found.params.fields else "")
                   + ("; output.format openai_batch: a record asking for n > 1 samples gets "
                      "them as one line's choices"
                      if found.params.output_format == "openai_batch" else ""))
    if found.source[0] == "batch" and found.generate["max_new_tokens"] > NEW_TOKENS:
        out.append(f"generate.max_new_tokens {found.generate['max_new_tokens']} covers the "
                   "requests' own max_tokens")
    if found.params:
        out += found.params.notes
    used = [found.text_field] if isinstance(found.text_field, str) else found.text_field
    if found.params:
        used = [*used, *found.params.fields.values()]
    if found.source[0] == "batch":
        used = [*used, "method", "url"]
    others = [n for n in p.texts if n not in used]
    if others:
        out.append(f"string fields not used: {', '.join(others)}")
    return out + sample_notes(found.model["dtype"], p)


def _longer(found: HfInferred) -> str:
    """What becomes of a text longer than the last seq bucket."""
    last = found.buckets["seq"][-1]
    if found.outliers:
        shown = ", ".join(f"{w} ({n:,} tokens)" for w, n in found.outliers[:MAX_LISTED])
        more = f" and {len(found.outliers) - MAX_LISTED} more" if len(
            found.outliers) > MAX_LISTED else ""
        cut = "from the left, keeping its end" if found.generate is not None else "there"
        # a generation spec rejects what it would cut unless truncate says otherwise
        fate = (f"cuts such a text {cut}" if found.truncate else
                f"rejects such a text with its line (truncate: true cuts it {cut} instead)")
        n = len(found.outliers)
        return (f"{n} text{'s' * (n > 1)} far longer than the rest, {shown}{more}, "
                f"{'were' if n > 1 else 'was'} planned "
                f"{'without' if found.generate is not None else 'as long as the rest'}: "
                f"data.text.max_length {last} "
                f"{fate} (raise it, up to {found.limit}, and add it to buckets.seq to keep "
                "more of them" + ("; or truncate: false to reject them)" if found.truncate
                                  else ")"))
    if last == found.limit:
        limit = ("the model's limit" if found.generate is None else
                 f"the model's {found.positions} positions less the new tokens")
        if not found.truncate:
            return (f"the last, {last}, is {limit}: a longer prompt is rejected with its line "
                    "(data.text.truncate: false; true cuts it from the left)")
        return (f"the last, {last}, is {limit}: a longer text is cut there "
                "(data.text.truncate: true)")
    return (f"the sample is the whole file, so a longer text is rejected "
            f"(data.text.truncate: false); if the file grows, add {found.limit} (the model's "
            "limit) to buckets.seq and set truncate: true")


def _places(said: list[str]) -> set[str]:
    """The places ("file:line") that "file:line: why" lines name."""
    return {line.split(": ", 1)[0] for line in said}


def _line(said: str) -> int:
    """The line (or row) a "file:line: why" names, for ordering; 0 where none is found."""
    found = re.match(r"[^:\[]*(?::|\[row )(\d+)", said)
    return int(found.group(1)) if found else 0
