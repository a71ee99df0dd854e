"""Parquet columns as the stream's records: the schema check of a file, and a decoded record
batch as Candidates (columnar where it can, Python values where a reason per record needs them).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from graphrun.base.errors import InputError
from graphrun.read.formats.dense import int64_ids
from graphrun.read.records import Candidates, RowWhere, field_from_arrow, field_from_values
from graphrun.spec.keys import PipelineSpec


def check_schema(spec: PipelineSpec, schema: pa.Schema, file: str) -> None:
    if spec.data.text is not None:  # a text column tokenized into the inputs (read/text.py)
        from graphrun.read.text import check_text_schema
        check_text_schema(spec, schema, file)
        spec = spec.model_copy(update={"inputs": {}})  # the id column's check below
    names = schema.names
    id_field = spec.data.id_field
    for name in list(spec.inputs) + ([id_field] if id_field else []):
        if name not in names:
            raise InputError(f"column {name!r} is missing (columns: {', '.join(names)})",
                             where=file)
    for name, inp in spec.inputs.items():
        t, depth = schema.field(name).type, 0
        while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            t, depth = t.value_type, depth + 1
        numeric = pa.types.is_integer(t) or pa.types.is_floating(t)
        if not (numeric or (pa.types.is_boolean(t) and inp.dtype == "bool")):
            raise InputError(f"column {name!r} holds {t}; expected {inp.dtype} numbers",
                             where=file)
        if depth != len(inp.shape) - 1:
            raise InputError(f"column {name!r} nests lists {depth} deep; input shape "
                             f"{inp.shape} needs {len(inp.shape) - 1} (one per dimension after "
                             f"batch)", where=file)
    if id_field:
        t = schema.field(id_field).type
        if not (pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)):
            raise InputError(f"id column {id_field!r} must hold integers or strings (one scalar "
                             f"per record), got {t}", where=file)


def parquet_candidates(spec: PipelineSpec, file: str, rb, first: int,
                       python_values: bool = True) -> Candidates | None:
    """The records of a record batch whose first row is `first`. Without python_values, None
    where an input column has to be read as Python values (nulls, ragged nested lists)."""
    if spec.data.text is not None:  # a text column tokenized into the inputs (read/text.py)
        from graphrun.read.text import parquet_text_candidates
        return parquet_text_candidates(spec, file, rb, first)
    n = rb.num_rows
    fields, problems = {}, {}
    for name, inp in spec.inputs.items():
        col = rb.column(name)
        columnar = field_from_arrow(col, len(inp.shape) - 1)
        if columnar is not None:
            fields[name] = columnar
            continue
        if not python_values:
            return None
        # nulls or ragged nested lists: read as Python values for a reason per record
        fields[name], found = field_from_values(name, inp, col.to_pylist())
        for p, reason in found.items():
            problems.setdefault(p, reason)
    ids = None
    if spec.data.id_field:
        col = rb.column(spec.data.id_field)
        ids = id_values(col)
        if col.null_count:  # a Python loop over the ids only when some are null
            for p in np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False)).tolist():
                problems.setdefault(p, f"missing id: {spec.data.id_field!r} is null")
    rows = np.arange(first, first + n, dtype=np.int64)
    return Candidates(rows, ids, RowWhere(file, rows), fields, problems)


def id_values(col) -> np.ndarray | list:
    """An integer id column without nulls as int64 (see dense.int64_ids), else Python values."""
    if pa.types.is_integer(col.type) and not col.null_count:
        return int64_ids(col.to_numpy(zero_copy_only=False))
    return col.to_pylist()
