"""`graphrun init`, the writing half: the inferred spec as commented YAML, beside its schema.

The modeline points at pipeline.schema.json in the spec's own folder, written there from the
installed graphrun, so an editor completes and checks keys wherever the spec lives.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import yaml

from graphrun.spec.keys import BATCH

SCHEMA_NAME = "pipeline.schema.json"
_PLAIN = re.compile(r"[A-Za-z_./][A-Za-z0-9_./-]*")
_COMMENT_COL = 44
# prompts per window of a generation spec at most (the whole file if fewer): a window's
# completions wait, unwritten (kept in finished.jsonl), for its first ones, held in memory
GROUP_WINDOW = 1024


def render_spec(found, spec_dir: Path, out_dir: str) -> str:
    """The spec's YAML text; `found` is init.Inferred."""
    p = found.profile
    lines = [
        f"# yaml-language-server: $schema={SCHEMA_NAME}",
        f"# Written by `graphrun init` from {p.sampled} records of {p.path.name} and two calls",
        "# of the model. Look at what `graphrun init` printed to check, then: graphrun validate",
        "# this file, graphrun run this file. Keys: graphrun's docs/spec.md.",
        "version: 1",
        f"name: {_scalar(found.name)}",
        _c("device: auto", "auto: cuda if present, else cpu"),
    ]
    return "\n".join(lines + _model_lines(found) + _buffer_lines(found)
                     + _run_lines(found, spec_dir, out_dir)) + "\n"


def _model_lines(found) -> list[str]:
    model = found.model
    source = "builtin" if "builtin" in model else "target"
    return [
        "model:",
        _c(f"  {source}: {_scalar(model[source])}",
           "builds the nn.Module" if source == "target" else "shipped with graphrun"),
        _c(f"  args: {_flow(model['args'])}", "keyword arguments of the builder"),
        _c(f"  dtype: {model['dtype']}", "float32 | float16 | bfloat16"),
        _c(f"  call: {found.call}", _call_comment(found)),
    ]


def _buffer_lines(found) -> list[str]:
    """inputs, outputs and buckets."""
    p = found.profile
    lines = [_c("inputs:", "the static buffers, in the model's call order")]
    for name, f in found.inputs.items():
        entry = {"shape": [BATCH, *f.dims], "dtype": f.dtype}
        if name in found.ranges:
            entry["range"] = list(found.ranges[name][:2])
        if f.kind != "bool":
            entry["pad"] = 0
        lines.append(_c(f"  {_key(name)}: {_flow(entry)}", _field_comment(found, name, f)))
    lines.append(_c("outputs:", "named from the model's return; cut back per record"))
    for name, (dims, dtype) in found.outputs.items():
        lines.append(_c(f"  {_key(name)}: {_flow({'shape': dims})}", f"{dtype} from the model"))
    graphs = 1
    for values in found.buckets.values():
        graphs *= len(values)
    lines.append(_c("buckets:", f"one graph per combination: {graphs}"))
    for axis, values in found.buckets.items():
        why = ("up to data.batch_size" if axis == BATCH else
               f"lengths {p.axes[axis][0]}-{p.axes[axis][1]} in the sample")
        lines.append(_c(f"  {axis}: {_flow(values)}", why))
    return lines


def _run_lines(found, spec_dir: Path, out_dir: str) -> list[str]:
    """capture, data and output."""
    p = found.profile
    varying_out = any(isinstance(d, str) for dims, _ in found.outputs.values() for d in dims[1:])
    fmt = "parquet" if p.format == "parquet" else ("jsonl" if varying_out else "npy")
    lines = [
        "capture:",
        _c("  backend: auto", "cuda-graph on a GPU, eager elsewhere"),
        _c("  warmup_iters: 3", "eager runs before each capture"),
        _c("  verify: {enabled: true, rtol: 1.0e-3, atol: 1.0e-3}", "replay == eager, pads"),
        "data:",
        f"  path: {_scalar(relative_to_spec(p.path, spec_dir))}",
    ]
    if p.id_field:
        lines.append(_c(f"  id_field: {_scalar(p.id_field)}", "kept beside the outputs"))
    return lines + [
        _c(f"  batch_size: {found.batch_size}", "records per batch"),
        _c("  on_bad_record: error", "error | skip (to rejects.jsonl)"),
        "output:",
        f"  dir: {_scalar(out_dir)}",
        _c(f"  format: {fmt}", "npy | jsonl | parquet" + (
            "; npy cannot hold per-record lengths" if varying_out else "")),
    ]


def _hf_model_lines(found) -> list[str]:
    """The spec's head for a Hugging Face model: version, name, device and model."""
    hf = found.model["hf"]
    return ["version: 1", f"name: {_scalar(found.name)}",
            _c("device: auto", "auto: cuda if present, else cpu"), "model:",
            _c(f"  hf: {_flow({'path': hf['path'], 'class': hf['class']})}",
               found.task.why.partition(":")[0]),
            _c(f"  dtype: {found.model['dtype']}", "float32 | float16 | bfloat16")]


def render_hf_spec(found, spec_dir: Path, out_dir: str) -> str:
    """The spec's YAML text for a Hugging Face model over text; `found` is
    init_hf.HfInferred."""
    p = found.profile
    lines = [
        f"# yaml-language-server: $schema={SCHEMA_NAME}",
        f"# Written by `graphrun init --hf` from {p.sampled} records of {p.path.name} and one",
        "# call of the model. Look at what `graphrun init` printed to check, then: graphrun",
        "# validate this file, graphrun run this file. Keys: graphrun's docs/spec.md.",
        *_hf_model_lines(found),
        _c("inputs:", "the tokenizer's, for each text"),
    ]
    for name in found.inputs:
        lo, hi, why = found.ranges[name]
        entry = {"shape": [BATCH, "seq"], "dtype": "int64", "range": [lo, hi], "pad": 0}
        lines.append(_c(f"  {_key(name)}: {_flow(entry)}", f"range: {why}"))
    lines.append(_c("outputs:", "computed inside the captured step"))
    for name, head in found.heads.items():
        entry = {"shape": head["shape"], **{k: v for k, v in head.items() if k != "shape"}}
        lines.append(f"  {_key(name)}: {_flow(entry)}")
    lines.append(_c("buckets:", "one graph per combination: "
                    f"{len(found.buckets[BATCH]) * len(found.buckets['seq'])}"))
    lines.append(_c(f"  {BATCH}: {_flow(found.buckets[BATCH])}",
                    "planned for the grouped batches' sizes"))
    lo, hi = found.lengths
    lines.append(_c(f"  seq: {_flow(found.buckets['seq'])}", f"tokens {lo}-{hi} in the sample"
                    + ("; the last: the model's limit" if found.buckets["seq"][-1] == found.limit
                       else "")))
    run = _run_lines(found, spec_dir, out_dir)
    at = run.index("output:")
    text = _flow(_text_key(found))
    last = found.buckets["seq"][-1]
    run.insert(at, _c(f"  text: {text}", f"longer than {last} tokens: " + (
        "cut" if found.truncate else "rejected")))
    run.insert(at + 1, _c(f"  group_by_length: {found.window}",
                          "similar lengths batched; outputs in input order"))
    return "\n".join(lines + run) + "\n"


def _text_key(found) -> dict:
    """data.text: the field, truncate, and max_length where outliers are cut short of the
    model's limit."""
    key = {"field": found.text_field, "truncate": found.truncate}
    return key if found.max_length is None else {**key, "max_length": found.max_length}


def render_generate_spec(found, spec_dir: Path, out_dir: str) -> str:
    """The spec's YAML text for a generation job over a causal LM; `found` is
    init_hf.HfInferred with its generate section."""
    p, gen = found.profile, found.generate
    lo, hi = found.lengths
    last = found.buckets["seq"][-1]
    lines = [
        f"# yaml-language-server: $schema={SCHEMA_NAME}",
        f"# Written by `graphrun init --hf --task generate` from {p.sampled} records of "
        f"{p.path.name}.",
        "# A generation job: one completion per prompt (id, token_ids, text, finish_reason,",
        "# prompt_tokens, output_tokens); inputs and outputs are implied. Look at what",
        "# `graphrun init` printed to check, then: graphrun validate this file, graphrun run",
        "# this file. Keys: graphrun's docs/spec.md.",
        *_hf_model_lines(found),
        "data:",
        f"  path: {_scalar(relative_to_spec(p.path, spec_dir))}",
    ]
    kind = found.source[0]
    cut = (f"longer than {last} tokens: " + ("cut from the left" if found.truncate else
                                             "rejected (truncate: true cuts from the left)"))
    if kind == "batch":
        lines.append(_c("  format: openai_batch", "OpenAI Batch request lines; id_field: "
                        "custom_id"))
    elif p.id_field:
        lines.append(_c(f"  id_field: {_scalar(p.id_field)}", "kept beside the completions"))
    if kind == "chat":
        lines.append(_c(f"  chat: {_flow({'field': found.text_field})}",
                        "messages rendered by the model's chat template"))
    text = _text_key(found)
    if kind not in ("text", "ids"):  # the prompt is the chat's or the request's, not a field's
        text.pop("field")
    said = {"text": "the prompt; ", "ids": "the prompt's token ids, taken as they are; "}
    lines += [
        _c(f"  text: {_flow(text)}", said.get(kind, "") + cut),
        _c(f"  batch_size: {found.batch_size}", "prompts per batch"),
        _c(f"  group_by_length: {found.window}", "similar lengths batched; output in input order"),
        _c("  on_bad_record: skip", "a request that cannot be served gets an error line in "
           "its place, as the Batch API's own do; error: the run stops at it")
        if kind == "batch" else _c("  on_bad_record: error", "error | skip (to rejects.jsonl)"),
        "generate:",
        _c(f"  max_new_tokens: {gen['max_new_tokens']}", "new tokens per prompt at most"),
        _c("  slots: auto", "records decoding at once: on a GPU what half its free memory "
           "holds (at most 256), on the CPU the largest batch"),
        _c(f"  sampling: {_flow(gen['sampling'])}",
           "or {method: sample, temperature: 0.8, top_p: 0.95, seed: 0}"
           if gen["sampling"]["method"] == "greedy" else "greedy: {method: greedy}"),
        _c(f"  stop: {_flow(gen['stop'])}",
           f"the model's EOS {found.eos_ids}" if found.eos_ids else "the model names no EOS"),
        *([_c(f"  per_record: {_flow(found.params.fields)}",
              "each record's own parameters: parameter: its field (null or absent: the "
              "spec's)")] if found.params and found.params.fields else []),
        _c("buckets:", f"graphs: {found.graphs.prefill} prefill + {found.graphs.decode} decode"),
        _c(f"  {BATCH}: {_flow(found.buckets[BATCH])}",
           "decode rows planned for the grouped batches (a GPU's slots: auto steps up to "
           "its own slots)"),
        _c(f"  seq: {_flow(found.buckets['seq'])}", f"prompt tokens {lo}-{hi} in the sample"
           + ("; the last: the model's limit less the new tokens" if last == found.limit
              else "")),
        "output:",
        f"  dir: {_scalar(out_dir)}",
        _c("  format: openai_batch", "the Batch API's output lines; or jsonl | parquet")
        if kind == "batch" else
        _c("  format: openai_batch", "a record's n samples are one line's choices")
        if found.params and found.params.output_format == "openai_batch" else
        _c("  format: jsonl", "jsonl | parquet | openai_batch"),
    ]
    return "\n".join(lines) + "\n"


def write_spec_files(spec_path: Path, text: str) -> tuple[Path, Path]:
    """The schema beside the spec (kept when it is someone else's file), then the spec,
    validated before it replaces anything."""
    from graphrun.base.errors import GraphrunError, SpecError
    from graphrun.manifest.schema import render
    from graphrun.spec.load import load_spec

    spec_path.parent.mkdir(parents=True, exist_ok=True)
    schema = spec_path.with_name(SCHEMA_NAME)
    ours = render("pipeline")
    current = schema.read_text() if schema.is_file() else None
    if current is None or (current != ours and '"graphrun pipeline spec' in current):
        schema.write_text(ours)
    tmp = spec_path.with_name(f".{spec_path.name}.init")
    tmp.write_text(text)
    try:
        load_spec(tmp)
    except SpecError as err:  # init wrote something the spec rules refuse: a bug in init
        tmp.unlink()
        raise GraphrunError(f"graphrun init wrote a spec that does not validate; please "
                            f"report it with the model and data:\n{err}") from err
    os.replace(tmp, spec_path)
    return spec_path, schema


def relative_to_spec(path: Path, spec_dir: Path) -> str:
    """How the spec names `path`: relative to its folder when they share more than the root
    (so the folder can move as a whole), else absolute."""
    path = path.resolve()
    if Path(os.path.commonpath([path, spec_dir])) == Path(path.anchor):
        return str(path)
    return os.path.relpath(path, spec_dir)



def _c(line: str, comment: str) -> str:
    return f"{line.ljust(_COMMENT_COL - 1)} # {comment}" if comment else line


def _call_comment(found) -> str:
    if found.call == "keyword":
        return "model(" + ", ".join(f"{n}=..." for n in found.inputs) + ")"
    return "model(" + ", ".join(found.inputs) + "), in this order"


def _field_comment(found, name: str, f) -> str:
    varying = [d for d in f.dims if isinstance(d, str)]
    parts = []
    if name in found.ranges:
        embedding = "nn.Embedding" in found.ranges[name][2]
        parts.append(f"seen {f.lo}..{f.hi}" + ("; range: the model's embedding" if embedding
                                                 else ": CHECK range"))
    if varying:
        parts.append(f"{', '.join(varying)} varies per record")
    if f.source_dtype not in (f.dtype, "int64", "float64"):
        parts.append(f"file: {f.source_dtype}")
    return "; ".join(parts)


def _key(name: str) -> str:
    return name if _PLAIN.fullmatch(name) and not _reserved(name) else json.dumps(name)


def _scalar(value) -> str:
    text = str(value)
    return text if _PLAIN.fullmatch(text) and not _reserved(text) else json.dumps(text)


def _reserved(text: str) -> bool:
    """Words YAML would read as something other than a string."""
    return text.lower() in ("true", "false", "yes", "no", "on", "off", "null", "~") or \
        re.fullmatch(r"[-+]?[0-9.]+(e[-+]?[0-9]+)?", text.lower()) is not None


def _flow(value) -> str:
    """A one-line YAML value: {shape: [batch, seq], dtype: int64}."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(str(k))}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if isinstance(value, str):
        return _scalar(value)
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...")
