"""`graphrun init`: write a first spec from the user's model and data file.

data sample (sample.py) -> buckets (powers of two up to the sample's largest) -> the model,
built as `run` builds it -> how it is called (keyword by name, else positional) -> two probe
calls on small padded batches of real records (output names, dtypes, which output sizes follow
batch or a bucket axis) -> the spec, commented, written beside its JSON schema and validated.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from graphrun.base.errors import GraphrunError, InputError, ModelError
from graphrun.init.sample import MAJORITY, DataProfile, FieldInfo, sample_data
from graphrun.init.render import (SCHEMA_NAME, relative_to_spec, render_spec,
                                  write_spec_files)
from graphrun.spec.keys import BATCH

MAX_LISTED = 20  # records listed by name among the "check:" lines; the rest counted


@dataclass
class Inferred:
    """What init learned, and what the user should look at before running."""

    name: str
    model: dict  # the spec's model section
    profile: DataProfile
    call: str = "keyword"
    inputs: dict[str, FieldInfo] = field(default_factory=dict)  # input name -> its field
    outputs: dict[str, tuple[list, str]] = field(default_factory=dict)  # name -> (dims, dtype)
    buckets: dict[str, list[int]] = field(default_factory=dict)
    ranges: dict[str, tuple[int, int, str]] = field(default_factory=dict)  # lo, hi, from what
    batch_size: int = 32
    checks: list[str] = field(default_factory=list)
    spec_path: Path | None = None
    schema_path: Path | None = None


def init(*, data: str | Path, target: str | None = None, builtin: str | None = None,
         spec_path: str | Path = "pipeline.yaml", out_dir: str | Path | None = None,
         args: dict | None = None, name: str | None = None, batch_size: int = 32,
         sample: int = 10000, id_field: str | None = None, dtype: str = "float32",
         force: bool = False) -> Inferred:
    """Infer a spec for the model (`target` "file.py:build" / "pkg.mod:build", or `builtin`)
    over `data`, write it to `spec_path` with pipeline.schema.json beside it, and return
    what was inferred. Paths given relative are relative to the working directory."""
    if (target is None) == (builtin is None):
        raise GraphrunError("give the model as exactly one of --model FILE.py:CALLABLE (or "
                            "pkg.module:callable), --builtin NAME and --hf DIR")
    spec_path = spec_target(spec_path, force)
    profile = sample_data(Path(data).resolve(), sample, id_field)
    source = {"builtin": builtin} if builtin else {"target": target}
    found = Inferred(name=name or _default_name(target or builtin), profile=profile,
                     model={**source, "args": dict(args or {}), "dtype": dtype},
                     batch_size=batch_size)
    found.buckets = propose_buckets(profile, batch_size)
    model = _build(found, Path.cwd())
    found.call, found.inputs = _call_convention(model, profile)
    found.buckets = propose_buckets(profile, batch_size, found.inputs)  # used axes only
    found.ranges, outside = _ranges(model, found.inputs, profile)
    outside += _position_limits(model, found)
    found.outputs = _probe_outputs(model, found)
    # ranges came first to keep the probe inside the model's tables; a probe that took whole
    # numbers as float32 leaves them none
    found.ranges = {n: r for n, r in found.ranges.items() if found.inputs[n].kind == "int"}
    if outside:  # under a line of their own, not read as the sample's bad records above them
        outside.insert(0, "records holding what the model's tables cannot take; `run` "
                          "rejects them (data.on_bad_record: skip) or stops at them (error):")
    found.checks += _checks(found) + outside
    spec_dir = spec_path.parent
    if target:
        found.model["target"] = _spec_target(target, spec_dir)
        found.checks += _import_check(target, spec_dir)
    text = render_spec(found, spec_dir, spec_out_dir(spec_path, out_dir))
    found.spec_path, found.schema_path = write_spec_files(spec_path, text)
    return found


def spec_target(spec_path: str | Path, force: bool) -> Path:
    """The spec file to write, absolute; an existing one only with --force."""
    spec_path = Path(spec_path).resolve()
    if spec_path.name == SCHEMA_NAME:  # the schema written beside it would be the spec itself
        raise GraphrunError(f"-o {SCHEMA_NAME}: that name is the schema's, which init writes "
                            "beside the spec: name the spec another file, e.g. -o pipeline.yaml")
    if spec_path.exists() and not force:
        raise GraphrunError(f"{spec_path} exists; pass --force to replace it, or -o another "
                            "file name")
    return spec_path


def propose_buckets(profile: DataProfile, batch_size: int,
                    inputs: dict[str, FieldInfo] | None = None) -> dict[str, list[int]]:
    """batch: powers of two below batch_size, and batch_size; every axis of `inputs` (default:
    of every field): powers of two from the sample's shortest length to its longest (both
    rounded up)."""
    batch = [b for b in _powers(1, batch_size) if b < batch_size] + [batch_size]
    buckets = {BATCH: batch}
    used = {d for f in (inputs or profile.fields).values() for d in f.dims if isinstance(d, str)}
    for axis, (lo, hi) in profile.axes.items():
        if axis in used:
            buckets[axis] = _powers(_ceil_pow2(lo), _ceil_pow2(hi))
    return buckets


def _powers(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


def _ceil_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _default_name(source: str) -> str:
    module = source.rpartition(":")[0] or source
    stem = Path(module).stem if module.endswith(".py") else module.rpartition(".")[2]
    return slug(stem)


def slug(text: str) -> str:
    """text as a name for a spec or a folder: letters, digits, _ and -."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-") or "pipeline"


# ---- the model: built as `run` builds it, then called on two padded batches ------------------

def _build(found: Inferred, cwd: Path):
    import torch

    from graphrun.models.load import build_model
    from graphrun.spec.keys import PipelineSpec

    # only model and the batch buckets matter to build_model (a builder may take max_batch)
    probe_spec = PipelineSpec.model_validate({
        "version": 1, "name": found.name, "model": found.model,
        "inputs": {"x": {"shape": [BATCH]}}, "outputs": {"y": {"shape": [BATCH]}},
        "buckets": {BATCH: found.buckets[BATCH]}, "data": {"path": found.profile.path},
        "output": {"dir": "out"}})
    return build_model(probe_spec, torch.device("cpu"), base_dir=cwd)


def _forward_params(model) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError, AttributeError):
        return None


def _call_convention(model, profile: DataProfile) -> tuple[str, dict[str, FieldInfo]]:
    """keyword when the forward's arguments are named like the data's fields (inputs in the
    forward's order); positional in the file's order otherwise."""
    fields = profile.fields
    params = _forward_params(model)
    if params is None or any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return "keyword", dict(fields)
    required = [n for n, p in params.items() if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    taken = [n for n in params if n in fields]
    if taken:
        missing = [n for n in required if n not in fields]
        if missing:
            raise InputError(f"the model's forward needs {missing}, which the file does not "
                             f"hold (fields: {', '.join(fields)})", where=str(profile.path))
        _leave_out(profile, [n for n in fields if n not in taken], params)
        return "keyword", {n: fields[n] for n in taken}
    positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY,
                                                             p.POSITIONAL_OR_KEYWORD)]
    if profile.format == "npy" and positional:  # a .npy array has no name: take the argument's
        only = next(iter(fields.values()))
        return "keyword", {positional[0]: only}
    if len(required) <= len(fields) <= len(positional):
        return "positional", dict(fields)
    raise ModelError(f"the model's forward takes ({', '.join(params)}) but the data's fields "
                     f"are {', '.join(fields)}: name the fields after the forward's arguments")


def _leave_out(profile: DataProfile, extra: list[str], params: dict) -> None:
    if not extra:
        return
    if profile.format == "jsonl":  # the reader rejects records with fields it does not use
        raise InputError(f"field {extra[0]!r} is not an argument of the model's forward "
                         f"({', '.join(params)}); JSONL records may hold only the inputs and "
                         "the id: drop it from the records", where=str(profile.path))
    profile.left_out.extend(extra)


def _probe_outputs(model, found: Inferred) -> dict[str, tuple[list, str]]:
    """Two calls, small batches of real records padded (or cut) to the smallest and then the
    largest bucket of every axis: an output size that follows batch or an axis from one call
    to the other is that axis, one that stays is fixed."""
    sizes_a = {a: v[0] for a, v in found.buckets.items() if a != BATCH}
    sizes_b = {a: (v[-1] if len(v) > 1 else max(1, v[0] // 2))
               for a, v in found.buckets.items() if a != BATCH}
    largest = found.buckets[BATCH][-1]
    sizes_a[BATCH], sizes_b[BATCH] = min(2, largest), min(3, largest)
    ret_a = _first_probe(model, found, sizes_a)
    ret_b = _call(model, found, sizes_b, "init's probe (the largest buckets)")
    outputs = {}
    for name, (a, b) in _named(ret_a, ret_b).items():
        if a.dim() == 0:
            raise ModelError(f"output {name!r} is one number (a 0-d tensor) for a batch of "
                             f"{sizes_a[BATCH]} records: graphrun needs the batch as every "
                             "output's first dimension (one row per record); a reduction over "
                             "the batch (x.sum(), x.mean()) drops it: reduce over the other "
                             "dimensions only (x.sum(dim=1))")
        dims = [_output_dim(name, i, da, db, sizes_a, sizes_b)
                for i, (da, db) in enumerate(zip(a.shape, b.shape))]
        outputs[name] = (dims, str(a.dtype).removeprefix("torch."))
    return outputs


def _first_probe(model, found: Inferred, sizes: dict[str, int]):
    """The first call; where it fails and some inputs hold whole numbers only (JSON `[1, 2]`),
    again with those as float32, which is what a model of floats would take."""
    what = "init's probe (the smallest buckets)"
    try:
        return _call(model, found, sizes, what)
    except ModelError as err:
        whole = [f for f in found.inputs.values() if f.kind == "int"]
        if not whole:
            raise
        for f in whole:
            f.kind = "float"
        try:
            ret = _call(model, found, sizes, what)
        except ModelError:
            for f in whole:
                f.kind = "int"
            raise err from None
        named = [n + (f" (the file's {f.name})" if f.name != n else "")
                 for n, f in found.inputs.items() if any(f is w for w in whole)]
        found.checks.append(f"inputs {', '.join(named)}: whole numbers only in the file, "
                            "which the model took as float32 (as integers it failed)")
        return ret


def _call(model, found: Inferred, sizes: dict[str, int], what: str):
    import torch

    from graphrun.base.dtypes import torch_dtype
    from graphrun.models.call import first_call

    model_dtype = torch_dtype(found.model["dtype"])
    tensors = {}
    for name, f in found.inputs.items():
        t = torch.from_numpy(_padded(f, sizes))
        tensors[name] = t.to(model_dtype) if t.is_floating_point() else t
    return first_call(model, tensors, found.call, what)


def _padded(f: FieldInfo, sizes: dict[str, int]) -> np.ndarray:
    """[batch, *dims] of the field's first records, padded with 0 (or cut) to `sizes`."""
    dims = [sizes[d] if isinstance(d, str) else d for d in f.dims]
    out = np.zeros([sizes[BATCH], *dims], dtype=f.dtype)
    for row in range(sizes[BATCH]):
        record = np.asarray(f.probe[row % len(f.probe)])
        cut = tuple(slice(0, min(n, m)) for n, m in zip(record.shape, dims))
        out[(row, *cut)] = record[cut]
    return out


def _named(ret_a, ret_b) -> dict:
    """name -> (return of call a, of call b): a tensor is `output`, a tuple's items
    `output0`, ..., a dict's (or ModelOutput's) tensors keep their keys."""
    import torch
    from collections.abc import Mapping

    if isinstance(ret_a, torch.Tensor):
        return {"output": (ret_a, ret_b)}
    if isinstance(ret_a, (tuple, list)):
        bad = [i for i, t in enumerate(ret_a) if not isinstance(t, torch.Tensor)]
        if bad:
            raise ModelError(f"the model returns a {type(ret_a).__name__} whose item {bad[0]} "
                             "is not a tensor; graphrun names tensors only: return a tuple of "
                             "tensors or a dict")
        return {f"output{i}": (a, b) for i, (a, b) in enumerate(zip(ret_a, ret_b))}
    if isinstance(ret_a, Mapping):
        named = {k: (v, ret_b[k]) for k, v in ret_a.items() if isinstance(v, torch.Tensor)}
        if named:
            return named
    raise ModelError(f"the model returned a {type(ret_a).__name__}; graphrun needs a tensor, "
                     "a tuple of tensors or a dict of tensors")


def _output_dim(name: str, i: int, da: int, db: int, sizes_a: dict, sizes_b: dict):
    if i == 0:
        if (da, db) != (sizes_a[BATCH], sizes_b[BATCH]):
            raise ModelError(f"output {name!r} has {da} rows for a batch of {sizes_a[BATCH]} "
                             f"records: graphrun needs the batch as every output's first "
                             "dimension (one row per record)")
        return BATCH
    if da == db:
        return int(da)
    axis = next((a for a in sizes_a if a != BATCH and (sizes_a[a], sizes_b[a]) == (da, db)),
                None)
    if axis is None:
        raise ModelError(f"output {name!r} dimension {i} was {da}, then {db}, following none "
                         "of the inputs' axes; graphrun cuts outputs only along batch and the "
                         "inputs' axes")
    return axis


def _spec_target(target: str, spec_dir: Path) -> str:
    """A file target relative to the spec's folder (the spec resolves it from there)."""
    module, _, attr = target.rpartition(":")
    if not module.endswith(".py"):
        return target
    return f"{relative_to_spec(Path(module), spec_dir)}:{attr}"


def _import_check(target: str, spec_dir: Path) -> list[str]:
    """A module target found in the working directory is imported beside the spec at run."""
    module = target.rpartition(":")[0]
    top = module.partition(".")[0]
    cwd = Path.cwd().resolve()
    if module.endswith(".py") or spec_dir == cwd:
        return []
    if (cwd / top).is_dir() or (cwd / f"{top}.py").is_file():
        return [f"model.target {target}: {top} was imported from {cwd}, but `run` imports "
                f"beside the spec ({spec_dir}): install it, move it there, or give the file "
                "form (path/to/file.py:callable)"]
    return []


def spec_out_dir(spec_path: Path, out_dir) -> str:
    """The written spec's output.dir: the one given, else runs/<the spec file's stem>, one
    folder per spec (two specs of one model must not share, or refuse, each other's folder)."""
    if out_dir is None:
        return f"runs/{slug(spec_path.stem)}"
    return relative_to_spec(Path(out_dir), spec_path.parent)


# ---- what to check ---------------------------------------------------------------------------

def _checks(found: Inferred) -> list[str]:
    p = found.profile
    seen = f"in the {p.sampled} records sampled" + (
        f" of {p.records}" if p.records and p.records > p.sampled else "")
    out = []
    for name, f in found.inputs.items():
        if name in found.ranges:
            lo, hi, why = found.ranges[name]
            out.append(f"inputs.{name}.range [{lo}, {hi}) from {why}; values {seen} lie in "
                       f"[{f.lo}, {f.hi}]: records with values outside the range are rejected")
        if f.source_dtype not in (f.dtype, "int64", "float64"):
            out.append(f"inputs.{name}.dtype {f.dtype}: the file holds {f.source_dtype}")
        if f.nonfinite:
            out.append(f"inputs.{name}: NaN or Inf {seen}; `finite: true` would reject them")
    padded = [n for n, f in found.inputs.items() if f.kind != "bool"]
    if padded:
        out.append(f"pad 0 fills padded rows and positions of {', '.join(padded)}; pick "
                   "another value where 0 means something to the model (verify checks that "
                   "padded rows and positions do not change real records' outputs)")
    for axis in (a for a in found.buckets if a != BATCH):
        lo, hi = p.axes[axis]
        out.append(f"buckets.{axis} {found.buckets[axis]}: lengths {lo}-{hi} {seen}; a longer "
                   f"record is rejected: raise the last value if the file holds longer ones")
    if found.call == "positional":
        out.append(f"model.call positional: the inputs are passed in the order "
                   f"{', '.join(found.inputs)}; reorder them if the forward wants another")
    out += sample_notes(found.model["dtype"], p)
    if p.left_out:
        out.append(f"fields not used as inputs: {', '.join(p.left_out)}")
    return out


def _ranges(model, inputs: dict[str, FieldInfo], profile: DataProfile
            ) -> tuple[dict[str, tuple[int, int, str]], list[str]]:
    """Integer inputs: [0, n) where the model has an nn.Embedding of n rows that holds the
    values of at least MAJORITY of the records, n a little above their largest (token ids,
    positions); else what the sample holds. The model's limit wins over the sample: the records
    outside it are listed (run rejects them) and left out of the probe calls."""
    from torch import nn

    tables = sorted({m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)})
    out, outside = {}, []
    for name, f in inputs.items():
        if f.kind != "int":
            continue
        rows = _table_for(tables, f.record_lo, f.record_hi)
        if rows is None:
            out[name] = (min(0, int(f.lo)), int(f.hi) + 1,
                         "the sample: widen it to all the model accepts")
            continue
        out[name] = (0, rows, f"the model's nn.Embedding of {rows} rows")
        bad = (f.record_lo < 0) | (f.record_hi >= rows)  # [n] records outside the table
        for i in np.flatnonzero(bad)[:MAX_LISTED]:
            value = f.record_lo[i] if f.record_lo[i] < 0 else f.record_hi[i]
            where = profile.wheres[i] if profile.wheres else f"{profile.path.name}[{i}]"
            outside.append(f"{where}: {name} holds {value}, outside [0, {rows}) (the model's "
                           "nn.Embedding): `run` rejects this record")
        if bad.sum() > MAX_LISTED:
            outside.append(f"... and {int(bad.sum()) - MAX_LISTED} more records of {name} "
                           f"outside [0, {rows})")
        f.probe = [v for v in f.probe if v.min() >= 0 and v.max() < rows] or [np.zeros(1, int)]
    return out, outside


def _position_limits(model, found: Inferred) -> list[str]:
    """An nn.Embedding no range took, of fewer rows than an axis' last bucket but at least as
    many as at least MAJORITY of the records' lengths, is read as a position table: the axis'
    buckets stop at its rows, and the longer records are listed (run rejects them)."""
    from torch import nn

    taken = {r[1] for r in found.ranges.values()}
    tables = sorted({m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
                    - taken)
    p, out = found.profile, []
    for axis in [a for a in found.buckets if a != BATCH]:
        lengths = next(f.lengths[d] for f in found.inputs.values()
                       for d, name in enumerate(f.dims) if name == axis)  # [n] per record
        last = found.buckets[axis][-1]
        rows = next((n for n in tables if n < last and (lengths <= n).sum()
                     >= MAJORITY * len(lengths)), None)
        if rows is None:
            continue
        found.buckets[axis] = [b for b in found.buckets[axis] if b < rows] + [rows]
        longer = np.flatnonzero(lengths > rows)
        for i in longer[:MAX_LISTED]:
            where = p.wheres[i] if p.wheres else f"{p.path.name}[{i}]"
            out.append(f"{where}: {lengths[i]} positions along {axis}, past the model's "
                       f"nn.Embedding of {rows} rows (its position table): `run` rejects "
                       "this record")
        if len(longer) > MAX_LISTED:
            out.append(f"... and {len(longer) - MAX_LISTED} more records longer than {rows}")
    return out


def _table_for(tables: list[int], lo: np.ndarray, hi: np.ndarray) -> int | None:
    """The smallest embedding that holds at least MAJORITY of the records ([n] smallest and
    largest values), and is at most twice their largest value (an id table, not a far
    bigger one)."""
    for rows in tables:
        fits = (lo >= 0) & (hi < rows)
        if fits.any() and fits.sum() >= MAJORITY * len(fits) and rows <= 2 * (hi[fits].max() + 1):
            return rows
    return None


def sample_notes(dtype: str, p: DataProfile) -> list[str]:
    """What every written spec's report says of its dtype, ids and the sample's bad records."""
    out = [f"model.dtype {dtype}: bfloat16 or float16 halve memory and time on a GPU "
           "(verify's tolerances widen with them)",
           "data.id_field " + (f"{p.id_field}: ids must be unique" if p.id_field else
                               "none: a record's position in the file is its id")]
    for records, many, one in (
            (p.skipped, "records of the sample could not be used and were left out",
             "record of the sample could not be used and was left out"),
            (p.disagree, "records disagree with the rest of the sample and were left out of "
                         "what was inferred", "record disagrees with the rest of the sample "
                                              "and was left out of what was inferred")):
        if records:
            it = "it" if len(records) == 1 else "them"
            out += [f"{len(records)} {one if len(records) == 1 else many}; `run` rejects {it} "
                    f"(data.on_bad_record: skip) or stops at {it} (error):",
                    *records[:MAX_LISTED]]
            if len(records) > MAX_LISTED:
                out.append(f"... and {len(records) - MAX_LISTED} more")
    return out
