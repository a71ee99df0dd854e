"""Text in, tokens out (data.text): a JSONL field or Parquet column of text (or two, a pair
tokenized together as the tokenizer's text pairs) tokenized with the model's fast tokenizer
into the inputs the spec lists (input_ids, attention_mask, token_type_ids), one batched call
per chunk, ahead of the stream: on the JSONL reader's threads (read/ahead.py), in its child
processes for a big file on many cores, or on Parquet's decoding pool; never on the thread
that launches the GPU work. The tokenizer's encode_batch runs on its own threads, off the GIL.

Each record keeps its id and its line (or row); a text that is not a string, or longer than
max_length tokens when truncate is false, is a bad record with its reason.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from graphrun.base.errors import InputError, ModelError
from graphrun.read.formats.dense import int64_ids
from graphrun.read.formats.jsonl_lines import close_field, encodable
from graphrun.read.prompts import Prompt, Prompts, kind
from graphrun.read.records import Candidates, Field, Reject, RowWhere
from graphrun.spec.keys import BATCH, PipelineSpec
from graphrun.spec.request import DEFAULT_PARAMS, REQUEST_FIELD

# the tokenizer's name for each input the model may take
ENCODING_FIELDS = {"input_ids": "ids", "attention_mask": "attention_mask",
                   "token_type_ids": "type_ids"}


def seq_axis(spec: PipelineSpec) -> str | None:
    dim = spec.inputs["input_ids"].shape[1] if "input_ids" in spec.inputs else None
    return dim if isinstance(dim, str) and dim != BATCH else None


def max_length(spec: PipelineSpec, folder: str) -> int:
    """Tokens per record at most: data.text.max_length, else the largest seq bucket, else (seq
    planned from the data) the tokenizer's model_max_length."""
    text = spec.data.text
    if text.max_length is not None:
        return text.max_length
    axis = seq_axis(spec)
    if axis is not None and spec.buckets.get(axis, "auto") != "auto":
        return max(spec.buckets[axis])
    if axis is None:  # a fixed size
        return int(spec.inputs["input_ids"].shape[1])
    try:
        config = json.loads((Path(folder) / "tokenizer_config.json").read_text())
        limit = int(config.get("model_max_length", 512))
    except (OSError, ValueError, TypeError):
        limit = 512
    return limit if 0 < limit < 1 << 20 else 512  # transformers writes 1e30 for "no limit"


@functools.lru_cache(maxsize=8)
def _tokenizer(folder: str, length: int, truncate: bool, direction: str = "right",
               trust_remote_code: bool = False):
    """A fast tokenizer without padding (the buckets pad), truncating at `length` if asked:
    from the right, or from the left for a generation job's prompts (their end is kept)."""
    from graphrun.models.hf import fast_tokenizer

    tok = fast_tokenizer(folder, trust_remote_code)
    tok.no_padding()
    if truncate:
        tok.enable_truncation(length, direction=direction)
    else:
        tok.no_truncation()
    return tok


def tokenize(spec: PipelineSpec, prompts: list[Prompt | None]
             ) -> tuple[dict[str, Field], dict[int, str], list[int]]:
    """prompts: one per record (None where the record is bad already) -> one Field per input
    (one int array per record), reasons by position, and the positions whose text truncate
    cut (the tokenizer kept what it cut in `overflowing`). A pair is encoded as the
    tokenizer's text pair, cut longest first as transformers' truncation=True cuts it. A
    prompt whose text holds its special tokens (a rendered chat) gets none added."""
    from graphrun.models.hf import remote_code, tokenizer_folder

    text = spec.data.text
    folder = tokenizer_folder(spec)
    length = max_length(spec, folder)
    problems = {p: "" for p, prompt in enumerate(prompts) if prompt is None}
    blank = ("", "") if text.pair else ""  # stands in for a bad record's text
    cut_from = "left" if spec.generate is not None else "right"
    tok = _tokenizer(folder, length, text.truncate, cut_from, remote_code(spec))
    encodings: list = [None] * len(prompts)
    for special in (True, False):  # one batched call per kind
        at = [p for p, prompt in enumerate(prompts)
              if prompt is not None and prompt.special == special]
        if at:
            for p, enc in zip(at, tok.encode_batch([prompts[p].text for p in at],
                                                   add_special_tokens=special)):
                encodings[p] = enc
    empty = (tok.encode(*blank) if text.pair else tok.encode(blank)) if problems else None
    encodings = [empty if enc is None else enc for enc in encodings]
    if not text.truncate:
        for p, enc in enumerate(encodings):
            if p not in problems and len(enc.ids) > length:
                problems[p] = (f"{text.named}: {len(enc.ids)} tokens, more than {length} "
                               "(the largest seq bucket or data.text.max_length); set "
                               "data.text.truncate: true to cut it"
                               + (" from the left" if spec.generate is not None else ""))
    cut = ([p for p, enc in enumerate(encodings) if enc.overflowing and p not in problems]
           if text.truncate else [])
    fields = {}
    for name, inp in spec.inputs.items():
        attr = ENCODING_FIELDS[name]
        dtype = np.dtype(inp.dtype)
        fields[name] = Field(arrays=[None if p in problems else
                                     np.asarray(getattr(enc, attr), dtype=dtype)
                                     for p, enc in enumerate(encodings)])
    problems = {p: why for p, why in problems.items() if why}  # the bad ones say so already
    return fields, problems, cut


def _prompted(spec: PipelineSpec, records: list[dict]
              ) -> tuple[list[Prompt | None], dict[int, str], dict[str, Field]]:
    """Each record's Prompt (None where it has none), reasons by position, and the request
    parameters' field (REQUEST_FIELD) where the records carry their own."""
    prompts = Prompts(spec)
    got = [prompts.of(r) for r in records]
    problems = {p: g for p, g in enumerate(got) if isinstance(g, str)}
    kept = [None if isinstance(g, str) else g for g in got]
    extra = {}
    if prompts.carries_params:
        params = np.empty(len(kept), dtype=object)
        params[:] = [DEFAULT_PARAMS if g is None else g.params for g in kept]
        extra[REQUEST_FIELD] = Field(dense=params)
    return kept, problems, extra


class TextCuts:
    """data.text: how many records' texts truncate cut to `length` tokens, counted as their
    checked chunks are read (each chunk once: the batches cut from it carry none); a record
    the run this one resumes read already (an ordinal below count_from) is not counted."""

    def __init__(self, spec: PipelineSpec, count_from: int = 0):
        from graphrun.models.hf import tokenizer_folder

        self.length = max_length(spec, tokenizer_folder(spec))
        self.side = "left" if spec.generate is not None else "right"
        self.count_from, self.count = count_from, 0

    def add(self, chunk) -> None:
        """A checked chunk (RecordBatch): its cut records counted."""
        if chunk.cut is not None:
            self.count += int(np.count_nonzero(chunk.cut >= self.count_from))


def jsonl_text_candidates(spec: PipelineSpec, file: str, records: list, reasons: list[str],
                          linenos: list[int], first: int) -> Candidates:
    """A JSONL block's parsed records (reasons: "" or why a line could not be parsed): each
    record's prompt (read/prompts.py) tokenized, fields it does not read ignored."""
    names, id_field = spec.data.text.fields, spec.data.id_field
    if spec.data.format == "openai_batch":
        names = []  # a request line's keys are read_request's to check
    good, rejects = [], []
    for p, record in enumerate(records):
        reason = reasons[p] or _record_problem(record, names, id_field)
        if reason:
            rid = record.get(id_field) if id_field and isinstance(record, dict) else None
            rejects.append(Reject(first + p, rid if id_field else first + p,
                                  f"{file}:{linenos[p]}", reason))
        else:
            good.append(p)
    prompts, problems, extra = _prompted(spec, [records[p] for p in good])
    fields, tokenized, cut = tokenize(spec, prompts)
    problems.update(tokenized)
    return Candidates(
        indices=np.array(good, np.int64) + first,
        ids=[records[p][id_field] for p in good] if id_field else None,
        where=[f"{file}:{linenos[p]}" for p in good],
        fields={**fields, **extra}, problems=problems, rejects=rejects, cut=cut)


def _record_problem(record, names: list[str], id_field: str | None) -> str:
    if not isinstance(record, dict):
        fields = " and ".join(repr(n) for n in names)
        return (f"the record is {kind(record)}; expected an object" + (
            "" if not names else f" with a {fields} field" if len(names) == 1
            else f" with fields {fields}"))
    for k, name in enumerate(names):
        if name not in record:
            what = ("the text to tokenize" if len(names) == 1 else
                    f"the pair's {('first', 'second')[k]} text, data.text.field "
                    f"[{', '.join(names)}]")
            return f"missing field {name!r} ({what})" + close_field(
                name, [f for f in record if f != id_field and f not in names])
    if id_field:
        rid = record.get(id_field)
        if rid is None:
            return f"missing id: field {id_field!r} is absent or null"
        if type(rid) not in (str, int):
            return f"id field {id_field!r} must be a string or an integer, got {kind(rid)}"
        if type(rid) is str and not encodable(rid):
            return (f"id field {id_field!r} is not valid Unicode (it holds a lone surrogate "
                    "escape such as \\ud800), so no output format can store it")
    return ""


def check_text_schema(spec: PipelineSpec, schema, file: str) -> None:
    import pyarrow as pa

    prompts = Prompts(spec)
    for field in prompts.fields:
        if field not in schema.names:
            raise InputError(f"column {field!r} is missing (columns: "
                             f"{', '.join(schema.names)})", where=file)
    for field in spec.data.text.fields:
        t = schema.field(field).type
        if spec.data.chat is None and not (pa.types.is_string(t) or pa.types.is_large_string(t)):
            raise InputError(f"text column {field!r} holds {t}; expected strings", where=file)


def parquet_text_candidates(spec: PipelineSpec, file: str, rb, first: int) -> Candidates:
    """A record batch's rows: each row's prompt tokenized (a null text is a bad record)."""
    import pyarrow as pa

    names = Prompts(spec).fields
    columns = {name: rb.column(name).to_pylist() for name in names}
    records = [dict(zip(columns, row)) for row in zip(*columns.values())]
    prompts, problems, extra = _prompted(spec, records)
    fields, tokenized, cut = tokenize(spec, prompts)
    problems.update(tokenized)
    ids = None
    if spec.data.id_field:
        col = rb.column(spec.data.id_field)
        ids = (int64_ids(col.to_numpy(zero_copy_only=False))
               if pa.types.is_integer(col.type) and not col.null_count else col.to_pylist())
        for p, v in enumerate(col.to_pylist() if col.null_count else []):
            if v is None:
                problems.setdefault(p, f"missing id: {spec.data.id_field!r} is null")
    rows = np.arange(first, first + rb.num_rows, dtype=np.int64)
    return Candidates(rows, ids, RowWhere(file, rows), {**fields, **extra}, problems, cut=cut)

