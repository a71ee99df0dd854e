"""Rules that tie several spec keys together. Each returns (key path, message), all at once."""

from __future__ import annotations

import errno
import importlib.util
import math
import os
from pathlib import Path
from typing import Iterator

from graphrun.base import dtypes
from graphrun.base.errors import InputError, ModelError
from graphrun.spec.chat_template import folder_template, no_chat_template
from graphrun.spec.endpoints import CHAT, file_endpoint
from graphrun.spec.keys import (BATCH, BUILTIN_NAMES, FLOAT_DTYPES, GENERATE_BUILTINS,
                                INPUT_SUFFIXES, INT_DTYPES, PipelineSpec)
from graphrun.spec.generate import CAUSAL_LM_SUFFIXES, PROMPT_AXIS
from graphrun.spec.paths import resolve_path

Found = Iterator[tuple[tuple, str]]
# One graph (or eager bucket) per combination of the axes' values is set up before the first
# record, a fraction of a second each: past this the grid is almost surely a mistake.
MAX_BUCKETS = 512
MAX_CUDA_INDEX = 127  # torch keeps a device index in 8 bits: cuda:128 wraps to cuda:-128


def resolve_paths(spec: PipelineSpec, base_dir: Path) -> PipelineSpec:
    """Relative paths in the spec are relative to the spec's folder, not the working directory.
    (A path that cannot be resolved, e.g. holding a NUL byte, is kept and reported by _files.)"""
    def abs_(p: Path | None) -> Path | None:
        if p is None or "\x00" in str(p):
            return p
        p = p if p.is_absolute() else (base_dir / p)
        try:
            return p.resolve()
        except (OSError, RuntimeError):  # a symlink loop: kept, and reported by _files
            return Path(os.path.abspath(p))

    spec.model.exported = abs_(spec.model.exported)
    spec.model.torchscript = abs_(spec.model.torchscript)
    spec.model.weights = abs_(spec.model.weights)
    spec.data.path = abs_(spec.data.path)
    spec.output.dir = abs_(spec.output.dir)
    return spec


def check_spec(spec: PipelineSpec, base_dir: Path | None = None) -> list[tuple[tuple, str]]:
    """base_dir: the spec's folder, where model.target's file or module is looked for."""
    found = []
    for rule in (_sections, _model_source, _axes, _ranges, _ragged_npy, _multiples, _batch_size,
                 _files, _device, _grid, _heads, _text, _generate, _requests):
        found.extend(rule(spec))
    found.extend(_target_found(spec, base_dir or spec.base_dir))
    found.extend(_hf_paths(spec, base_dir or spec.base_dir))
    found.extend(_chat_template(spec, base_dir or spec.base_dir))
    return found


def _requests(spec: PipelineSpec) -> Found:
    """OpenAI Batch files in and out, and per-record parameters: where each applies."""
    d, g = spec.data, spec.generate
    if d.format == "openai_batch" and d.path.suffix != ".jsonl":
        yield ("data", "format"), (f"an OpenAI Batch file is JSONL (one request per line), "
                                   f"not {d.path.suffix or 'this file'}")
    if spec.output.format == "openai_batch" and g is None:
        yield ("output", "format"), ("openai_batch writes completions: it needs a generation "
                                     "job (generate:, data.chat or data.format openai_batch)")
    if g is not None and g.per_record.fields:
        if d.format == "openai_batch":
            yield ("generate", "per_record"), ("an OpenAI Batch request's body holds its own "
                                               "parameters: remove per_record")
        elif d.path.suffix not in (".jsonl", ".parquet"):
            yield ("generate", "per_record"), ("per-record parameters are read from JSONL or "
                                               "Parquet records")


def _chat_template(spec: PipelineSpec, base_dir: Path) -> Found:
    """Chat records need a chat template: the spec's file, or the tokenizer's own, found as
    read/chat finds it (spec/chat_template.py); a hub name's is looked for when the records
    are read."""
    d = spec.data
    chat_file = d.format == "openai_batch" or d.chat is not None
    if not chat_file or d.text is None:
        return
    if d.chat is not None and d.chat.template is not None:
        path = Path(d.chat.template)
        path = path if path.is_absolute() else base_dir / path
        if not path.is_file():
            yield ("data", "chat", "template"), f"no template file {str(path)!r}"
        return
    where = d.text.tokenizer or (spec.model.hf.path if spec.model.hf else None)
    if where is None:
        return
    try:
        folder = Path(resolve_path(where, base_dir, "data.text.tokenizer"))
    except ModelError:
        return  # _hf_paths reports a folder that cannot be found
    if not folder.is_dir():
        return  # a hub name
    key = ("data", "chat") if d.chat is not None else ("data", "format")
    try:
        template, _ = folder_template(folder)
    except InputError as e:
        yield key, str(e)
        return
    if template is None and (d.chat is not None or file_endpoint(d.path) == CHAT):
        yield key, no_chat_template(folder)


def _target_found(spec: PipelineSpec, base_dir: Path) -> Found:
    """model.target's file (or top-level module) exists, without importing it: importing runs
    the user's code, which `graphrun validate --load` does."""
    target = spec.model.target
    if not target or ":" not in target or "\x00" in target:
        return
    module = target.rpartition(":")[0]
    if module.endswith(".py"):
        path = Path(module) if Path(module).is_absolute() else base_dir / module
        if not path.is_file():
            yield ("model", "target"), (f"file not found: {path.resolve()}; model.target's "
                                        "file is relative to the spec's folder")
        return
    top = module.split(".")[0]
    if not top:
        return
    if (base_dir / f"{top}.py").is_file() or (base_dir / top).is_dir():
        return
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        yield ("model", "target"), (f"module {top!r} not found beside the spec ({base_dir}) "
                                    "nor on the Python path; put it there, install its "
                                    "package, or give a file path such as "
                                    "'models/net.py:build'")


def _model_source(spec: PipelineSpec) -> Found:
    m = spec.model
    given = [k for k in ("builtin", "target", "exported", "torchscript", "hf", "timm")
             if getattr(m, k)]
    if not given:
        yield ("model",), ("no model source: give exactly one of builtin, target, exported, "
                           "torchscript, hf, timm")
    elif len(given) > 1:
        yield ("model", given[1]), (f"two model sources ({' and '.join(given)}): keep exactly "
                                    "one")
    if m.builtin:
        if m.builtin not in BUILTIN_NAMES + GENERATE_BUILTINS:
            yield ("model", "builtin"), (f"unknown builtin {m.builtin!r}; the builtins are "
                                         f"{', '.join(sorted(BUILTIN_NAMES))} and, with "
                                         f"generate:, {', '.join(GENERATE_BUILTINS)}")
        elif m.builtin in GENERATE_BUILTINS and spec.generate is None:
            yield ("model", "builtin"), (f"the builtin {m.builtin} is a generating model: add "
                                         "a generate: section (generate: {max_new_tokens: "
                                         "128}), or use the builtin decoder for one step")
    if m.target and ":" not in m.target:
        yield ("model", "target"), (f"expected 'package.module:callable' or 'file.py:callable' "
                                    f"(got {m.target!r})")


def _sections(spec: PipelineSpec) -> Found:
    """inputs, outputs and buckets: required for a forward pass, implied by generate:."""
    for key in ("inputs", "outputs"):
        given = key in spec.model_fields_set
        if spec.generate is not None:
            if getattr(spec, key):  # an empty one, as a dumped spec holds, says nothing
                yield (key,), (f"with generate: the {key} are implied (the tokenizer's "
                               "input_ids and attention_mask in, the completion out): remove "
                               f"{key}:")
        elif not given:
            yield (key,), f"required key {key!r} is missing"
        elif not getattr(spec, key):
            yield (key,), f"needs at least one {key[:-1]}"
    if spec.generate is None and "buckets" not in spec.model_fields_set:
        yield ("buckets",), ("required key 'buckets' is missing (e.g. buckets: {batch: [1, 8, "
                             "32]}); a generation spec plans its own")


GENERATE_AXES = (BATCH, "seq")  # rows of the decode graph; prompt lengths of the prefill


def _generate(spec: PipelineSpec) -> Found:
    """A generation job: text prompts, a causal LM, buckets batch and seq."""
    gen = spec.generate
    if gen is None:
        return
    if gen.min_new_tokens > gen.max_new_tokens:
        yield ("generate", "min_new_tokens"), (
            f"{gen.min_new_tokens} is more than max_new_tokens ({gen.max_new_tokens}): lower "
            "it or raise max_new_tokens")
    if spec.data.text is None:
        yield ("data",), ("with generate: the prompts are text, tokenized by the model's "
                          "tokenizer: add data.text: {field: prompt} naming the prompt's field")
    m = spec.model
    if m.hf is not None:
        if not m.hf.class_.endswith(CAUSAL_LM_SUFFIXES):
            yield ("model", "hf", "class"), (
                f"{m.hf.class_} is no causal LM, and generate: needs one: use "
                "AutoModelForCausalLM (or a class such as LlamaForCausalLM, GPT2LMHeadModel)")
    elif m.builtin in GENERATE_BUILTINS and isinstance(m.args.get("vocab"), int):
        yield from _stop_ids(spec, m.args["vocab"], "model.args.vocab")
    elif m.builtin not in GENERATE_BUILTINS:
        source = next((k for k in ("builtin", "target", "exported", "torchscript", "timm")
                       if getattr(m, k)), None)
        if source is not None:  # none at all: _model_source says so
            yield ("model", source), (
                "generate: needs a causal LM: model.hf (class AutoModelForCausalLM or another "
                f"causal-LM class) or builtin {' or '.join(GENERATE_BUILTINS)}")
    for axis in spec.buckets:
        if axis not in GENERATE_AXES:
            yield ("buckets", axis), (f"a generation job has the bucket axes batch (decode "
                                      f"rows) and seq (prompt lengths) only: remove {axis}")
    if "seq" not in spec.buckets:
        yield ("buckets",), ("a generation job needs buckets.seq: the prompt lengths prefill "
                             "is captured for, e.g. seq: [32, 64, 128, 256]")
    elif gen.prefill_tokens is not None and isinstance(spec.buckets["seq"], list) and \
            gen.prefill_tokens < max(spec.buckets["seq"]):
        yield ("generate", "prefill_tokens"), (
            f"{gen.prefill_tokens} is less than the longest prompt (the largest buckets.seq, "
            f"{max(spec.buckets['seq'])}), which one prefill must hold: raise it or remove it")
    yield from _kv_blocks(spec)
    if gen.n > 1 and spec.output.format != "openai_batch":
        yield ("generate", "n"), (f"{gen.n} samples per prompt are written as an OpenAI Batch "
                                  "line's choices: set output.format: openai_batch, or n: 1")
    if spec.output.format == "npy":
        yield ("output", "format"), ("a generation job writes completions of their own lengths "
                                     "and their text, which npy files cannot hold: use jsonl or "
                                     "parquet")
    if spec.report.baseline != "none":
        yield ("report", "baseline"), ("a generation job has no per-bucket eager baseline; "
                                       "compare with `graphrun bench` or "
                                       "benchmarks/bench_generate.py, and set baseline: none")


def _kv_blocks(spec: PipelineSpec) -> Found:
    """generate.kv_blocks holds one record at its longest (the largest buckets.seq, or where
    it is auto one prompt token, and max_new_tokens) beside the trash block: fewer would
    never admit a record (the engine refuses them at its build)."""
    gen, seq = spec.generate, spec.buckets.get(PROMPT_AXIS)
    if gen.kv_blocks is None:
        return
    longest = max(seq) if isinstance(seq, list) and seq else None
    tokens = (longest or 1) + gen.max_new_tokens
    need = -(-tokens // gen.kv_block_size) + 1
    if gen.kv_blocks < need:
        record = (f"the longest prompt ({longest}, the largest buckets.seq)" if longest
                  else "a prompt of one token")
        yield ("generate", "kv_blocks"), (
            f"{gen.kv_blocks} blocks of {gen.kv_block_size} tokens cannot hold one record: "
            f"{record} and max_new_tokens ({gen.max_new_tokens}) take {need - 1}, and one more "
            f"is the trash block: give {need} or more, or leave kv_blocks out (enough for "
            "every slot's longest record)")


def _axes(spec: PipelineSpec) -> Found:
    if BATCH not in spec.buckets:
        yield ("buckets",), "the record axis 'batch' needs bucket values, e.g. batch: [1, 8, 32]"
    used: set[str] = set()
    for kind, table in (("inputs", spec.inputs), ("outputs", spec.outputs)):
        for name, item in table.items():
            if item.shape[0] != BATCH:
                yield (kind, name, "shape", 0), (f"the first dimension must be 'batch', the "
                                                 f"record axis (got {item.shape[0]!r})")
            for i, dim in enumerate(item.shape):
                if isinstance(dim, str):
                    if kind == "inputs":
                        used.add(dim)
                    if dim not in spec.buckets and dim != BATCH:
                        yield (kind, name, "shape", i), (
                            f"axis {dim!r} has no bucket values: add buckets.{dim}: [...] or "
                            "use a fixed integer size")
            extra = [d for d in item.shape[1:] if d == BATCH]
            if extra:
                yield (kind, name, "shape"), "'batch' may appear only as the first dimension"
    for axis in spec.buckets:
        if spec.generate is None and axis not in used:  # generate: its own axes (_generate)
            yield ("buckets", axis), (f"bucket axis {axis!r} is used by no input shape; remove it "
                                      "or use it in an input")
    if spec.data.group_by_length and len(spec.buckets) == 1 and BATCH in spec.buckets:
        yield ("data", "group_by_length"), (
            "batches are grouped by length on the bucket axes besides batch (e.g. seq), and "
            "this spec has none: every record has one shape already; remove the key")


def _ranges(spec: PipelineSpec) -> Found:
    for name, item in spec.inputs.items():
        if item.range is None:
            continue
        lo, hi = item.range
        if not (math.isfinite(lo) and math.isfinite(hi)):
            yield ("inputs", name, "range"), f"bounds must be finite numbers (got [{lo}, {hi}])"
        elif item.dtype not in INT_DTYPES:
            yield ("inputs", name, "range"), (f"range applies to integer inputs only "
                                              f"(dtype is {item.dtype}); remove it")
        elif lo >= hi:
            yield ("inputs", name, "range"), f"needs lo < hi (got [{lo:g}, {hi:g}])"
        elif lo != int(lo) or hi != int(hi):
            yield ("inputs", name, "range"), f"bounds must be integers (got [{lo:g}, {hi:g}])"
        elif not lo <= item.pad < hi:
            # padded positions reach the model as real values do: a pad past the range is
            # an index past the model's table (an IndexError at the first padded batch)
            yield ("inputs", name, "pad"), (
                f"pad {item.pad:g} lies outside range [{lo:g}, {hi:g}): the model gets it at "
                "every padded position; set pad inside the range (the tokenizer's pad id, "
                "or 0)")
    for name, item in spec.inputs.items():
        if item.finite and item.dtype not in FLOAT_DTYPES:
            yield ("inputs", name, "finite"), (f"finite applies to float inputs only (dtype is "
                                               f"{item.dtype}); remove it")


def _ragged_npy(spec: PipelineSpec) -> Found:
    if spec.output.format != "npy":  # the one format of fixed-shape outputs (write/sinks/npy.py)
        return
    for name, item in spec.outputs.items():
        ragged = [d for d in item.shape[1:] if isinstance(d, str)]
        if ragged:
            yield ("outputs", name, "shape"), (
                f"axis {ragged[0]!r} varies per record, which npy files cannot hold: set "
                "output.format to jsonl or parquet")


def _multiples(spec: PipelineSpec) -> Found:
    for axis, m in spec.buckets_multiple_of.items():
        values = spec.buckets.get(axis)
        if values is None:
            yield ("buckets_multiple_of", axis), f"{axis!r} is no bucket axis"
        elif values != "auto" and any(v % m for v in values):
            yield ("buckets", axis), (f"values must be multiples of {m} (buckets_multiple_of."
                                      f"{axis}); got {values}")


def _batch_size(spec: PipelineSpec) -> Found:
    if (BATCH not in spec.buckets or spec.data.oversize == "split"
            or spec.buckets[BATCH] == "auto"):
        return
    largest = max(spec.buckets[BATCH])
    if (spec.data.oversize == "eager" and spec.model.builtin == "decoder"
            and spec.data.batch_size > largest):
        yield ("data", "oversize"), (
            f"the decoder's KV cache holds the largest batch bucket ({largest} rows), so it "
            f"cannot run a batch of {spec.data.batch_size} eagerly: set data.oversize: split")
        return
    if spec.data.batch_size > largest:
        yield ("data", "batch_size"), (
            f"{spec.data.batch_size} is larger than the largest batch bucket ({largest}) and "
            f"oversize is {spec.data.oversize!r}: lower batch_size, add a bucket, or set "
            "data.oversize: split")


def _files(spec: PipelineSpec) -> Found:
    for key, p in (("data", "path"), spec.data.path), (("output", "dir"), spec.output.dir):
        if "\x00" in str(p):
            yield key, "a path cannot hold a NUL character"
    path = spec.data.path
    if "\x00" in str(path):
        return
    if path.suffix not in INPUT_SUFFIXES:
        yield ("data", "path"), (f"unknown input format {path.suffix or '(no suffix)'!r}: use "
                                 f"one of {', '.join(INPUT_SUFFIXES)}")
    elif not path.is_file():
        yield ("data", "path"), _missing("input file", path)
    for key in ("exported", "torchscript", "weights"):
        p = getattr(spec.model, key)
        if p is not None and not p.is_file():
            yield ("model", key), _missing("file", p)
    out = spec.output.dir
    if "\x00" not in str(out) and (out.is_file() or (out.exists() and not out.is_dir())):
        yield ("output", "dir"), (f"{out} is a file, not a folder: give the folder the "
                                  "outputs go in (it is made where missing)")


def _missing(what: str, path: Path) -> str:
    if path.is_dir():  # it exists: "not found" sent the user looking for a typo
        return f"{path} is a folder, not a file: give the {what} itself"
    try:
        os.stat(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            return f"{path} is a loop of symbolic links: point it at the real file"
    return f"{what} not found: {path}"


def _device(spec: PipelineSpec) -> Found:
    if spec.device.startswith("cuda:") and int(spec.device[5:]) > MAX_CUDA_INDEX:
        yield ("device",), (f"{spec.device} names no device (torch numbers CUDA devices 0.."
                            f"{MAX_CUDA_INDEX}): use cuda or cuda:N for one of this machine's")


def _grid(spec: PipelineSpec) -> Found:
    """At most MAX_BUCKETS buckets, and static buffers that fit in this machine's memory:
    estimated before anything is allocated (torch would fail with a bare allocator error)."""
    # auto axes are planned at run start so that all axes make at most max_graphs (plan/auto.py)
    sizes = [len(v) for v in spec.buckets.values() if v != "auto"]
    count = max(math.prod(sizes), spec.max_graphs) if spec.auto_axes else math.prod(sizes)
    if count > MAX_BUCKETS:
        grid = f"{' x '.join(map(str, sizes))} = " if len(sizes) > 1 and not spec.auto_axes else ""
        yield ("buckets",), (f"{grid}{count:,} buckets, more than {MAX_BUCKETS} "
                             "(each may be warmed up, captured and verified): keep the sizes "
                             "the data needs (graphrun plan suggests them)")
    largest = {axis: max(v) for axis, v in spec.buckets.items() if v and v != "auto"}
    need = 0
    for items, default in ((spec.inputs, None), (spec.outputs, "float32")):
        for item in items.values():
            dims = [largest.get(d, 1) if isinstance(d, str) else d for d in item.shape]
            dtype = getattr(item, "dtype", None) or default
            itemsize = 4 if dtype in (None, "bfloat16") else _itemsize(dtype)
            need += math.prod(dims) * itemsize
    have = _memory_bytes()
    if have and need > have:
        yield ("buckets",), (f"the static buffers at the largest bucket "
                             f"({', '.join(f'{a}={n:,}' for a, n in largest.items())}) need "
                             f"{need / 2**30:,.1f} GiB, more than this machine's "
                             f"{have / 2**30:,.1f} GiB of memory: lower the largest bucket")


def _itemsize(dtype: str) -> int:
    return dtypes.ITEMSIZE.get(dtype, 4)


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def _heads(spec: PipelineSpec) -> Found:
    for name, o in spec.outputs.items():
        if "mean_pool" in o.reduce and o.mask not in spec.inputs:
            yield ("outputs", name, "mask"), (
                f"mean_pool needs the mask input {o.mask!r}, which inputs does not list: add "
                "it (attention_mask: {shape: [batch, seq], dtype: int64}) or name the mask "
                "input here")


def _text(spec: PipelineSpec) -> Found:
    text = spec.data.text
    if text is None:
        return
    if text.tokenizer is None and spec.model.hf is None:
        yield ("data", "text", "tokenizer"), ("the model is no Hugging Face model (model.hf): "
                                              "give the tokenizer's folder")
    if spec.data.path.suffix not in (".jsonl", ".parquet"):
        yield ("data", "text"), (f"text is read from .jsonl or .parquet files, not "
                                 f"{spec.data.path.suffix or 'this file'}")
    if spec.generate is not None:  # the generation job tokenizes into inputs of its own
        if text.pair:
            yield ("data", "text", "field"), ("with generate: each record is one prompt: name "
                                              "its one field, not a pair")
        return
    other = [n for n in spec.inputs if n not in TEXT_INPUTS]
    if other:
        yield ("inputs", other[0]), (f"with data.text the inputs come from the tokenizer: "
                                     f"name them among {', '.join(TEXT_INPUTS)}")
    elif "input_ids" not in spec.inputs:
        yield ("inputs",), "with data.text the inputs need input_ids: {shape: [batch, seq]}"
    for name, inp in spec.inputs.items():
        if len(inp.shape) != 2 or not isinstance(inp.shape[1], str):
            yield ("inputs", name, "shape"), ("a tokenized input is [batch, seq], seq a bucket "
                                              "axis: texts have lengths of their own")


def _hf_paths(spec: PipelineSpec, base_dir: Path) -> Found:
    """model.hf.path and data.text.tokenizer name a folder that exists (a hub name is looked
    up in the local cache when the model is loaded)."""
    keys = []
    if spec.model.hf is not None:
        keys.append((("model", "hf", "path"), spec.model.hf.path))
    if spec.data.text is not None and spec.data.text.tokenizer is not None:
        keys.append((("data", "text", "tokenizer"), spec.data.text.tokenizer))
    for key, path in keys:
        try:
            folder = resolve_path(path, base_dir, ".".join(key))
        except ModelError as e:
            yield key, str(e).split(": ", 1)[1]
            continue
        if key == ("model", "hf", "path"):
            if Path(folder).is_dir() and not (Path(folder) / "config.json").is_file():
                yield key, (f"{folder} is not a model folder: it holds no config.json; give "
                            "the folder from_pretrained loads (config.json and the weights)")
                continue
            yield from _past_positions(spec, folder)
            if spec.generate is not None and Path(folder).is_dir():
                from graphrun.spec.paths import model_vocab

                yield from _stop_ids(spec, model_vocab(Path(folder)), "config.json's vocab_size")
        text = spec.data.text
        if text is not None and (key[0] == "data" or text.tokenizer is None):
            yield from _tokenizer_files(spec, key, folder)


# a tokenizer is read from tokenizer.json, or made from a slow tokenizer's own files
TOKENIZER_FILES = ("tokenizer.json", "*.model", "vocab.json", "vocab.txt", "*.tiktoken")


def _tokenizer_files(spec: PipelineSpec, key: tuple, folder: str) -> Found:
    """The folder the texts are tokenized with holds a tokenizer's files (a folder's own
    Python, where trust_remote_code lets it run, may read others)."""
    hf = spec.model.hf
    if not Path(folder).is_dir() or (hf is not None and hf.trust_remote_code):
        return
    if any(next(Path(folder).glob(pattern), None) for pattern in TOKENIZER_FILES):
        return
    if key[0] == "data":
        yield key, (f"{folder} holds no tokenizer (tokenizer.json, or a slow tokenizer's "
                    "tokenizer.model, vocab.json and merges.txt, vocab.txt): give the folder "
                    "the model's tokenizer was saved in (tokenizer.save_pretrained)")
    else:
        yield ("data", "text", "tokenizer"), (
            f"not given, so the texts are tokenized with the model folder's tokenizer, and "
            f"{folder} holds none (tokenizer.json, or a slow tokenizer's tokenizer.model, "
            "vocab.json and merges.txt, vocab.txt): save the model's tokenizer there "
            "(tokenizer.save_pretrained), or give its folder here")


def _stop_ids(spec: PipelineSpec, vocab: int | None, said: str) -> Found:
    """generate.stop.token_ids within the model's vocabulary: an id past it is never picked,
    so the stop would never come."""
    if vocab is None:
        return
    bad = [t for t in spec.generate.stop.token_ids if t >= vocab]
    if bad:
        yield ("generate", "stop", "token_ids"), (
            f"{', '.join(map(str, bad))} past the model's vocabulary of {vocab} ({said}): give "
            f"ids below {vocab}")


def _past_positions(spec: PipelineSpec, folder: str) -> Found:
    """No seq bucket past the model's position table: the model cannot run it (a raw
    'size of tensor a must match' from inside its forward)."""
    from graphrun.spec.paths import model_positions

    ids = spec.inputs.get("input_ids")
    axis = ids.shape[1] if ids is not None and len(ids.shape) > 1 else None
    new = spec.generate.max_new_tokens if spec.generate is not None else 0
    axis = PROMPT_AXIS if spec.generate is not None else axis  # a prompt and its new tokens
    values = spec.buckets.get(axis) if isinstance(axis, str) else None
    found = model_positions(Path(folder)) if Path(folder).is_dir() else None
    if found is None:
        return
    positions, key = found
    if new >= positions:  # no prompt can fit, whatever the buckets (auto ones too)
        yield ("generate", "max_new_tokens"), (
            f"{new} new tokens leave no room for a prompt in the model's {positions} positions "
            f"(config.json's {key}), which a prompt and its new tokens share: set it below "
            f"{positions}, leaving room for the longest prompt")
        return
    if not isinstance(values, list) or max(values) + new <= positions:
        return
    if new:
        yield ("buckets", axis), (
            f"{max(values)} + generate.max_new_tokens ({new}) is past the model's {positions} "
            f"positions (config.json's {key}), which a prompt and its new tokens share: end "
            f"the list at {positions - new} or below, or lower max_new_tokens (graphrun plan "
            "proposes values within it)")
        return
    yield ("buckets", axis), (f"{max(values)} is past the model's {positions} positions "
                              f"(config.json's {key}): end the list at {positions} or below "
                              "(graphrun plan proposes values within it)")
