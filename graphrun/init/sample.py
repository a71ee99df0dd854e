"""`graphrun init`, the data half: what a sample of the input file says about the inputs.

Field names, per-record ranks, which sizes are fixed and which vary (and by how much), element
kinds, integer ranges, and which field looks like a record id. Sizes that vary together (a
`tokens` and a `mask` of the same length in every record) share one bucket axis.

The sample is inferred from its majority: where at least MAJORITY of the records agree (on a
rank, a kind, a size, two fields' lengths), the few that disagree are left out and listed, with
their line and why, rather than turning a field float32 or a fixed size into a bucket axis.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from graphrun.base.errors import InputError

SUFFIXES = (".jsonl", ".npy", ".npz", ".parquet")
PROBE_RECORDS = 8  # records kept per field for the model's probe calls
SAMPLE_BYTES = 64 << 20  # a dense array's sample holds at most this much (and PROBE_RECORDS)
SKIPPED = "\0skipped"  # the readers' entry for records left out of the sample, with why
WHERE = "\0where"  # the readers' entry for each record's place (file:line, file[row n])
MAJORITY = 0.9  # this share of the sample agreeing makes the rest outliers, not the rule
_ID_NAMES = re.compile(r"^(id|ids|uid|guid|key|idx|index)$|_id$|^id_", re.IGNORECASE)


class _Absent:
    """A text record's value of a field it does not hold (a JSONL record's fields may differ;
    the run tells a field absent from one that is null)."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()


@dataclass
class FieldInfo:
    """One field of the records, as the sample shows it."""

    name: str
    kind: str  # float | int | bool | str | object (JSON objects, lists of them)
    source_dtype: str  # as stored (numpy's name); JSON numbers read as int64/float64
    dims: list  # per record, after batch: an int (fixed) or an axis name (varies)
    lo: float | None = None  # integers: the smallest and largest value seen
    hi: float | None = None
    nonfinite: bool = False  # floats: NaN or Inf seen
    probe: list = field(default_factory=list)  # the first records' values, for the probe
    lengths: list = field(default_factory=list)  # per dim: [n] lengths, or None where fixed
    record_lo: np.ndarray | None = None  # integers: [n] each record's smallest and largest value
    record_hi: np.ndarray | None = None

    @property
    def dtype(self) -> str:
        """The static buffer's dtype: graphrun's usual one for the kind."""
        return {"float": "float32", "int": "int64", "bool": "bool"}[self.kind]


@dataclass
class DataProfile:
    path: Path
    records: int | None  # in the whole file, where cheap to know
    sampled: int
    fields: dict[str, FieldInfo]  # candidate inputs, in the file's order
    id_field: str | None
    axes: dict[str, tuple[int, int]]  # axis -> (shortest, longest) in the sample
    left_out: list[str]  # fields that are neither inputs nor the id (Parquet, npz)
    skipped: list[str] = field(default_factory=list)  # records left out of the sample, and why
    texts: dict[str, list] = field(default_factory=dict)  # text=True: string fields' values
    wheres: list[str] = field(default_factory=list)  # per record sampled: file:line
    disagree: list[str] = field(default_factory=list)  # "where: field ...: why", left out
    # text=True: fields of objects or lists of objects (chat messages, a request's body)
    objects: dict[str, list] = field(default_factory=dict)
    # text=True: fields of whole numbers, a list per record: prompts of token ids, which a
    # generation job reads as they are
    token_ids: dict[str, list] = field(default_factory=dict)
    # text=True: each sampled record as the run reads it (a field it lacks is absent)
    rows: list[dict] = field(default_factory=list)

    @cached_property
    def values(self) -> dict[str, list]:
        """Every field of the sampled rows, its value per row (None: absent or null): the
        fields the run may read besides the text (a record's own generation parameters)."""
        names = dict.fromkeys(name for row in self.rows for name in row)
        return {name: [row.get(name) for row in self.rows] for name in names}

    @property
    def format(self) -> str:
        return self.path.suffix.lstrip(".")

    @property
    def whole(self) -> bool:
        """Every record of the file was read: those left out (bad lines, the few that
        disagree) are records the run rejects too, so no record the sample did not see can
        come."""
        read = self.sampled + len(self.skipped) + len(self.disagree)
        return self.records is not None and self.records <= read


def sample_data(path: Path, limit: int, id_field: str | None = None, *,
                text: bool = False) -> DataProfile:
    """Read the first `limit` records of `path` and describe them. text: the records hold text
    to tokenize (init --hf): string fields are kept with their values (profile.texts), only
    a field named like an id is taken for the id, and no numeric field is needed."""
    if path.suffix not in SUFFIXES:
        raise InputError(f"unknown input format {path.suffix or '(no suffix)'!r}: use one of "
                         f"{', '.join(SUFFIXES)}", where=str(path))
    if not path.is_file():
        raise InputError("input file not found", where=str(path))
    if path.suffix == ".jsonl":
        columns, total = _read_jsonl(path, limit, text)
    elif path.suffix == ".parquet":
        columns, total = _read_parquet(path, limit, text)
    else:
        columns, total = {".npy": _read_npy, ".npz": _read_npz}[path.suffix](path, limit)
    skipped = columns.pop(SKIPPED, [])
    wheres = columns.pop(WHERE, None)
    disagree: list[str] = []
    if text and wheres is not None:
        return _text_profile(path, columns, total, skipped, wheres, id_field)
    if wheres is not None and columns:  # per-record values: outvote the few that disagree
        columns, wheres, disagree = outvote(columns, wheres, id_field or "")
    sampled = len(next(iter(columns.values()))) if columns else 0
    if sampled == 0:
        raise InputError("holds no records to learn the inputs from"
                         + (f"; the first left out: {disagree[0]}" if disagree else ""),
                         where=str(path))
    fields = {n: _describe(path, n, v) for n, v in columns.items()}
    named = {n: f for n, f in fields.items() if f.kind != "str" or _ID_NAMES.search(n)}
    chosen = _pick_id(named if text and id_field is None else fields, id_field, path)
    if chosen:
        del fields[chosen]
    left_out = [n for n, f in fields.items() if f.kind == "str"]
    objects = [n for n, f in fields.items() if f.kind == "object"]
    if text:  # a dense file (npy, npz)
        ids = {n: columns[n] for n, f in fields.items() if f.kind == "int" and len(f.dims) == 1}
        return DataProfile(path, total, sampled, {}, chosen, {}, left_out, skipped,
                           {n: columns[n] for n in left_out}, wheres or [], disagree,
                           {n: columns[n] for n in objects}, ids)
    if objects:
        raise InputError(f"field {objects[0]!r} holds object values, not numbers",
                         where=str(path))
    if left_out and path.suffix == ".jsonl":
        raise InputError(f"field {left_out[0]!r} holds strings, and every JSONL field must be "
                         "an input (numbers) or the id: turn it into numbers (token ids) or "
                         "drop it from the records, or pass --id-field if it is the id",
                         where=str(path))
    for n in left_out:
        del fields[n]
    if not fields:
        raise InputError("has no numeric field to use as an input", where=str(path))
    axes = _name_axes(fields)
    return DataProfile(path, total, sampled, fields, chosen, axes, left_out, skipped, {},
                       wheres or [], disagree)


def _text_profile(path: Path, columns: dict[str, list], total: int, skipped: list[str],
                  wheres: list[str], id_field: str | None) -> DataProfile:
    """Records of text (init --hf). A field may be absent from or null in some records (a
    record's own parameters, metadata): the run reads only the text's field, the id and the
    parameters the spec maps, and init checks those once it knows them. Only fields of
    lists of numbers, token ids perhaps, are outvoted: a few lists of another rank or kind
    among them are the records left out."""
    lists = [n for n, v in columns.items()
             if all(isinstance(x, np.ndarray) and x.ndim >= 1 for x in v)]
    disagree: list[str] = []
    if lists:
        kept, kept_wheres, disagree = outvote({n: columns[n] for n in lists}, wheres, None)
        keep = set(kept_wheres)
        at = [i for i, w in enumerate(wheres) if w in keep]
        columns = {n: kept[n] if n in kept else [v[i] for i in at] for n, v in columns.items()}
        wheres = kept_wheres
    if not wheres:
        raise InputError("holds no records to learn the inputs from"
                         + (f"; the first left out: {disagree[0]}" if disagree else ""),
                         where=str(path))
    fields = {n: _describe_text(path, n, v) for n, v in columns.items()}
    # a string field is the id only where named as one: another holds the text
    named = {n: f for n, f in fields.items() if f.kind != "str" or _ID_NAMES.search(n)}
    chosen = _pick_id(named if id_field is None else fields, id_field, path)
    others = [n for n in columns if n != chosen]
    texts = [n for n in others if fields[n].kind == "str"]
    # as JSON held them: the run's checks read these (a whole float 16.0 stays a float)
    raw = {n: [v.tolist() if isinstance(v, np.ndarray) else v for v in column]
           for n, column in columns.items()}
    return DataProfile(
        path, total, len(wheres), {}, chosen, {}, texts, skipped,
        texts={n: columns[n] for n in texts}, wheres=wheres, disagree=disagree,
        objects={n: columns[n] for n in others if fields[n].kind == "object"},
        token_ids={n: columns[n] for n in others
                   if fields[n].kind == "int" and len(fields[n].dims) == 1},
        rows=[{n: column[i] for n, column in raw.items() if column[i] is not ABSENT}
              for i in range(len(wheres))])


def _describe_text(path: Path, name: str, values: list) -> FieldInfo:
    """A text record's field from its values that are there (None: absent or null); one
    that no input could be (mixed ranks, lists of strings) is an object."""
    present = [v for v in values if v is not None and v is not ABSENT]
    if any(isinstance(v, str) for v in present):
        return FieldInfo(name, "str", "str", [], probe=present[:PROBE_RECORDS])
    if not present or not all(isinstance(v, np.ndarray) for v in present):
        return FieldInfo(name, "object", "object", [], probe=present[:PROBE_RECORDS])
    try:
        return _describe(path, name, present)
    except InputError:
        return FieldInfo(name, "object", "object", [], probe=present[:PROBE_RECORDS])


# ---- readers: name -> per-record values (a list) or a dense [n, ...] array --------------------

def _read_jsonl(path: Path, limit: int, text: bool = False) -> tuple[dict, int]:
    """A record that cannot be used (not JSON, other fields, ragged) is left out of the sample
    and counted in the "skipped" entry; `run` rejects or stops at it as the spec says.
    text: records may differ in their fields (None where one is absent or null)."""
    from graphrun.read.formats.jsonl_lines import lines_of

    columns: dict[str, list] = {}
    total, skipped, wheres = 0, [], []
    with open(path, "rb") as f:
        source = lines_of(f)  # as `run` reads the file: a BOM skipped, CR-only lines split
        lines = (line for block in iter(lambda: source.readlines(1 << 16), []) for line in block)
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            total += 1
            if total > limit:
                continue  # keep counting the file's records
            try:
                record = _jsonl_record(line, columns, f"{path.name}:{lineno}", text)
            except InputError as err:
                skipped.append(str(err))
                continue
            for name in record:  # in the record's order: the fields' order is the file's
                if name not in columns:  # absent from the records before
                    columns[name] = [ABSENT] * len(wheres)
            for name, values in columns.items():
                values.append(record.get(name, ABSENT))
            wheres.append(f"{path.name}:{lineno}")
    if skipped and not columns:
        raise InputError(f"no record of the sample could be used; the first: {skipped[0]}",
                         where=str(path))
    return {**columns, SKIPPED: skipped, WHERE: wheres}, total


def _jsonl_record(line: bytes, columns: dict, where: str, text: bool) -> dict:
    from graphrun.read.formats.jsonl_parse import parse_line

    record, reason = parse_line(line)  # the reason `run` gives the same line
    if reason:
        raise InputError(reason, where=where)
    if not isinstance(record, dict):
        raise InputError("a record must be a JSON object {\"field\": value, ...}", where=where)
    if columns and set(record) != set(columns) and not text:
        raise InputError(f"fields {sorted(record)} differ from the first record's "
                         f"{sorted(columns)}", where=where)
    return {name: _value(value, where, name, text) for name, value in record.items()}


def _value(value, where: str, name: str, text: bool):
    """A field's value as the sample holds it (_as_array). text: a null stays None, and a
    value that is no array of numbers stays as it is: which fields the run reads, and what
    it requires of them, is known only once init has chosen the text's field."""
    if not text:
        return _as_array(value, where, name)
    if value is None:
        return None
    try:
        return _as_array(value, where, name)
    except InputError:
        return value


def _read_npy(path: Path, limit: int) -> tuple[dict, int]:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - a damaged header raises all sorts
        raise InputError(f"cannot read the .npy file: {e}", where=str(path)) from e
    if array.ndim == 0:
        raise InputError("holds a scalar, not an array of records", where=str(path))
    return {path.stem: _head(array, limit)}, len(array)


def _read_npz(path: Path, limit: int) -> tuple[dict, int]:
    import zipfile

    if not zipfile.is_zipfile(path):  # np.load would take it for a pickle, and say so
        raise InputError("cannot read the .npz file: File is not a zip file (np.savez "
                         "writes one)", where=str(path))
    try:
        arrays = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # noqa: BLE001
        raise InputError(f"cannot read the .npz file: {e}", where=str(path)) from e
    with arrays:
        out = {n: _head(arrays[n], limit) for n in arrays.files}
        n = min((len(v) for v in out.values()), default=0)
        out = {k: v[:n] for k, v in out.items()}  # as many records of every array
        lengths = {n: len(arrays[n]) for n in arrays.files}
    if len(set(lengths.values())) > 1:
        raise InputError(f"arrays hold different numbers of records: {lengths}",
                         where=str(path))
    return out, next(iter(lengths.values()), 0)


def _head(array: np.ndarray, limit: int) -> np.ndarray:
    """The first records of a (memory-mapped) array, at most SAMPLE_BYTES of them."""
    row_bytes = max(1, array[:1].nbytes)
    return np.asarray(array[:max(PROBE_RECORDS, min(limit, SAMPLE_BYTES // row_bytes))])


def _read_parquet(path: Path, limit: int, text: bool = False) -> tuple[dict, int]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        batch = next(pf.iter_batches(batch_size=limit), None)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds
        raise InputError(f"cannot read the Parquet file: {e}", where=str(path)) from e
    if batch is None:
        return {}, 0
    columns: dict[str, list] = {n: [] for n in batch.schema.names}
    skipped, wheres = [], []
    values = [col.to_pylist() for col in batch.columns]
    for i, row in enumerate(zip(*values)):
        where = f"{path.name}[row {i}]"
        try:  # a null or ragged row is left out of the sample, as a bad JSONL line is
            row = [_value(v, where, n, text) for n, v in zip(columns, row)]
        except InputError as err:
            skipped.append(str(err))
            continue
        for n, v in zip(columns, row):
            columns[n].append(v)
        wheres.append(where)
    if skipped and not wheres:
        raise InputError(f"no record of the sample could be used; the first: {skipped[0]}",
                         where=str(path))
    return {**columns, SKIPPED: skipped, WHERE: wheres}, pf.metadata.num_rows


def _as_array(value, where: str, name: str):
    if isinstance(value, str) or is_structured(value):
        return value  # a text, or chat messages / a request body: read as they are
    if value is None:
        raise InputError(f"field {name!r} is null; inputs need a value in every record",
                         where=where)
    try:
        array = np.asarray(value)
    except ValueError as e:
        raise InputError(f"field {name!r} is ragged (its nested lists differ in length): {e}",
                         where=where) from None
    if array.dtype.kind not in "biuf":
        raise InputError(f"field {name!r} holds {array.dtype} values, not numbers",
                         where=where)
    return array


def is_structured(value) -> bool:
    """An object, or a list of objects (chat messages): JSON that is no array of numbers."""
    return isinstance(value, dict) or (isinstance(value, list) and bool(value)
                                       and all(isinstance(v, dict) for v in value))


# ---- describing a field ----------------------------------------------------------------------

def _describe(path: Path, name: str, values) -> FieldInfo:
    if isinstance(values, np.ndarray):  # dense: every record has the same shape
        info = _summarise(name, values.dtype, list(values.shape[1:]), values[:PROBE_RECORDS],
                          values, [None] * (values.ndim - 1))
        if info.kind == "int" and values.size:
            per = values.reshape(len(values), -1)  # [n, elements]
            info.record_lo, info.record_hi = per.min(1), per.max(1)
        return info
    if any(isinstance(v, str) for v in values):
        return FieldInfo(name, "str", "str", [], probe=values[:PROBE_RECORDS])
    if any(isinstance(v, (dict, list)) for v in values):
        return FieldInfo(name, "object", "object", [], probe=values[:PROBE_RECORDS])
    ranks = {v.ndim for v in values}
    if len(ranks) > 1:
        raise InputError(f"field {name!r} has records of ranks {sorted(ranks)}; an input "
                         "needs the same rank in every record", where=str(path))
    rank = ranks.pop()
    dims, lengths = [], []
    for d in range(rank):
        sizes = np.array([v.shape[d] for v in values])
        fixed = bool((sizes == sizes[0]).all())
        dims.append(int(sizes[0]) if fixed else None)
        lengths.append(None if fixed else sizes)
    kinds = [v.dtype for v in values]
    dtype = np.result_type(*kinds) if kinds else np.dtype("float32")
    flat = np.concatenate([v.ravel() for v in values]) if rank else np.array(values)
    info = _summarise(name, dtype, dims, values[:PROBE_RECORDS], flat, lengths)
    if info.kind == "int" and flat.size:
        info.record_lo = np.array([int(v.min()) if v.size else 0 for v in values])
        info.record_hi = np.array([int(v.max()) if v.size else 0 for v in values])
    return info


def _summarise(name, dtype, dims, probe, values, lengths) -> FieldInfo:
    kind = {"b": "bool", "i": "int", "u": "int", "f": "float"}.get(np.dtype(dtype).kind)
    if kind is None:
        return FieldInfo(name, "str", str(dtype), [], probe=list(probe))
    info = FieldInfo(name, kind, str(np.dtype(dtype)), dims, probe=list(probe),
                     lengths=lengths)
    if kind == "int" and values.size:
        info.lo, info.hi = int(values.min()), int(values.max())
    elif kind == "float" and values.size:
        info.nonfinite = not bool(np.isfinite(values).all())
    return info


def _pick_id(fields: dict[str, FieldInfo], asked: str | None, path: Path) -> str | None:
    """The field given by --id-field, else one scalar field of unique strings or integers whose
    name says id (`id`, `key`, `..._id`), else a lone string field."""
    if asked is not None:
        if asked not in fields:
            raise InputError(f"--id-field {asked!r} is not a field of the file (fields: "
                             f"{', '.join(fields)})", where=str(path))
        return asked
    scalar = [f for f in fields.values() if not f.dims and f.kind in ("int", "str")]
    named = [f.name for f in scalar if _ID_NAMES.search(f.name)]
    strings = [f.name for f in scalar if f.kind == "str"]
    if len(named) == 1:
        return named[0]
    if len(strings) == 1 and not named:
        return strings[0]
    return None


def _name_axes(fields: dict[str, FieldInfo]) -> dict[str, tuple[int, int]]:
    """Give every varying dim an axis name: dims whose lengths agree record by record share
    one (`seq`, then `seq2`, ...)."""
    axes: dict[str, tuple[int, int]] = {}
    seen: list[tuple[np.ndarray, str]] = []
    for f in fields.values():
        for d, sizes in enumerate(f.lengths):
            if sizes is None:
                continue
            name = next((a for s, a in seen if len(s) == len(sizes) and (s == sizes).all()),
                        None)
            if name is None:
                name = "seq" if not seen else f"seq{len(seen) + 1}"
                seen.append((sizes, name))
                axes[name] = (int(sizes.min()), int(sizes.max()))
            f.dims[d] = name
    return axes



# ---- the majority: records that disagree with at least MAJORITY of the sample ----------------

def outvote(columns: dict[str, list], wheres: list[str],
            inputs_of: str | None = "") -> tuple[dict, list, list[str]]:
    """The records that agree with the sample's majority, their places, and one line per record
    left out ("file:line: field ...: why"). Numeric fields only; strings are the id or text.
    inputs_of: None for text records (no field need be numeric), else the --id-field given."""
    n = len(wheres)
    why: dict[int, str] = {}
    for name, values in columns.items():  # a few texts among a numeric field's records
        odd = [i for i, x in enumerate(values) if isinstance(x, (str, dict, list))]
        if (odd and len(odd) <= (1 - MAJORITY) * n and inputs_of is not None
                and name != inputs_of and not _ID_NAMES.search(name)):  # ids mix kinds
            for i in odd:
                what = "a string" if isinstance(values[i], str) else "JSON objects"
                why.setdefault(i, f"{name} holds {what} where {n - len(odd)} of {n} records "
                                  "hold numbers")
    numeric = {k: v for k, v in columns.items()
               if not any(isinstance(v[i], (str, dict, list)) for i in range(n) if i not in why)}
    for name, values in numeric.items():
        idx = [i for i in range(n) if not isinstance(values[i], (str, dict, list))]
        for j, reason in _field_outliers(name, [values[i] for i in idx]).items():
            why.setdefault(idx[j], reason)
    for i, reason in _axis_outliers(numeric, [i for i in range(n) if i not in why]).items():
        why.setdefault(i, reason)
    keep = [i for i in range(n) if i not in why]
    for name in numeric:  # whole-valued floats of an integer field (JSON 3.0) become integers
        values = columns[name]
        if _kind_of([values[i] for i in keep]) == "int":
            for i in keep:
                if values[i].dtype.kind == "f":
                    values[i] = values[i].astype(np.int64)
    kept = {k: [v[i] for i in keep] for k, v in columns.items()}
    return kept, [wheres[i] for i in keep], [f"{wheres[i]}: {why[i]}" for i in sorted(why)]


def _agreed(items: list) -> tuple[object, int] | None:
    """The value at least MAJORITY of `items` share, and how many; None where none does."""
    if not items:
        return None
    values, counts = np.unique(np.array(items, dtype=object).astype(str), return_counts=True)
    top = int(counts.argmax())
    if counts[top] < MAJORITY * len(items):
        return None
    return next(x for x in items if str(x) == values[top]), int(counts[top])


def _kind_of(values: list) -> str:
    """int where every record's values are whole numbers, else float (bool: bool)."""
    kinds = {v.dtype.kind for v in values if v.size}
    if kinds <= {"b"}:
        return "bool"
    if all(v.dtype.kind in "biu" or _whole(v) for v in values if v.size):
        return "int"
    return "float"


def _whole(v: np.ndarray) -> bool:
    return v.dtype.kind == "f" and bool(np.isfinite(v).all()) and bool((v == np.round(v)).all())


def _field_outliers(name: str, values: list) -> dict[int, str]:
    """index -> why, for records of one field that are empty, or of another rank, kind or
    fixed size than at least MAJORITY of the others."""
    n = len(values)
    out = {i: f"{name} is empty" for i, v in enumerate(values) if v.ndim and v.size == 0}
    rest = [i for i in range(n) if i not in out]
    agreed = _agreed([values[i].ndim for i in rest])
    if agreed is not None:
        rank, count = agreed
        for i in rest:
            if values[i].ndim != rank:
                out[i] = (f"{name} has rank {values[i].ndim} where {count} of {len(rest)} "
                          f"records have rank {rank}")
    rest = [i for i in rest if i not in out]
    whole = [i for i in rest if values[i].dtype.kind in "biu" or _whole(values[i])]
    if whole and len(whole) >= MAJORITY * len(rest):
        for i in rest:
            if i not in whole:
                v = values[i].ravel()
                shown = v[(v != np.round(v)) | ~np.isfinite(v)][0]
                out[i] = (f"{name} holds {shown}, not a whole number, where {len(whole)} of "
                          f"{len(rest)} records hold whole numbers only")
    rest = [i for i in rest if i not in out]
    ranks = {values[i].ndim for i in rest}
    for d in range(ranks.pop() if len(ranks) == 1 else 0):
        sizes = [values[i].shape[d] for i in rest]
        agreed = _agreed(sizes)
        if agreed is None or agreed[1] == len(rest):
            continue  # varies (a bucket axis), or fixed in every record
        size, count = agreed
        for i, s in zip(rest, sizes):
            if s != size:
                out.setdefault(i, f"{name} has {s} at dimension {d + 1} where {count} of "
                               f"{len(rest)} records have {size}")
    return out


def _axis_outliers(fields: dict[str, list], rest: list[int]) -> dict[int, str]:
    """index -> why, for records where two fields' varying lengths differ although they agree
    in at least MAJORITY of the others (a `mask` one shorter than its `tokens`)."""
    varying = []  # (field, dim, [len(rest)] sizes)
    for name, values in fields.items():
        ranks = {values[i].ndim for i in rest}
        for d in range(ranks.pop() if len(ranks) == 1 else 0):
            sizes = np.array([values[i].shape[d] for i in rest])
            if len(rest) and not (sizes == sizes[0]).all():
                varying.append((name, d, sizes))
    out: dict[int, str] = {}
    for a, (name_a, _, sa) in enumerate(varying):
        for name_b, _, sb in varying[a + 1:]:
            same = sa == sb
            if same.all() or same.sum() < MAJORITY * len(rest):
                continue
            for j in np.flatnonzero(~same):
                out.setdefault(rest[j], f"{name_b} has {sb[j]} positions where {name_a} has "
                               f"{sa[j]} (they are as long in {int(same.sum())} of "
                               f"{len(rest)} records)")
    return out
