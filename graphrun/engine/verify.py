"""Verify: a lane's replay computes what eager computes, and padded rows cannot move real rows.

Run once per bucket and lane right after capture, on a synthetic batch drawn from the inputs' ranges
(integers in [lo, hi), floats from a normal distribution), seeded per bucket so that every lane
sees the same batch and a failure reproduces. The bucket's eager reference on that batch is
taken once, by its last warm-up run (capture.py), and shared by every lane's checks:
  1. replay vs the eager reference, within rtol/atol;
  2. pad isolation: fill the padded rows (the second half of the batch) with other values and
     replay again: the real rows' outputs must not move.
Then once more on the first real batch that reaches the bucket (verify_real_batch): replay vs
eager on those inputs, as synthetic values need not exercise what real data does; once per
bucket, at setup when the reader holds that batch already (Launcher.check_ahead), else in the
stream on whichever lane runs it.
Results are the manifest's types (VerifyResult, BatchCheck), kept on the lane's graph entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from graphrun.engine.buckets import Bucket
from graphrun.manifest.keys import BatchCheck, VerifyResult
from graphrun.spec.keys import FLOAT_DTYPES, InputSpec, allowed_picks

HALF_DTYPES = (torch.bfloat16, torch.float16)
ULP_SLACK = 2


def synthetic_values(dtype: str, value_range: tuple | None, shape, gen: torch.Generator
                     ) -> torch.Tensor:
    """Seeded sample values for an input of the spec's `dtype`: bool, float32 from a normal
    distribution, or int64 in value_range [lo, hi) (none: [0, 2), small values are safest)."""
    if dtype == "bool":
        return torch.randint(0, 2, tuple(shape), generator=gen).bool()
    if dtype in FLOAT_DTYPES:
        return torch.randn(tuple(shape), generator=gen)
    lo, hi = value_range or (0, 2)
    return torch.randint(int(lo), int(hi), tuple(shape), generator=gen)


def fill_synthetic(views: dict[str, torch.Tensor], specs: dict[str, InputSpec],
                   gen: torch.Generator, rows: slice = slice(None)) -> None:
    """Write seeded sample values into `views[name][rows]` for every input."""
    for name, t in views.items():
        target, spec = t[rows], specs[name]
        target.copy_(synthetic_values(spec.dtype, spec.range, target.shape, gen).to(target.dtype))


def compare(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float
            ) -> tuple[bool, float, float]:
    """(close, max abs error, max relative error), NaNs in the same places counting as equal.

    Half-precision outputs (bfloat16, float16) also get ULP_SLACK units of their precision at
    the output's largest magnitude added to atol: kernels chosen under capture may round
    differently from eager ones, and an intermediate rounded one unit apart moves every
    output, near-zero ones included, by about that much (a bfloat16 logit of 4 has a unit of
    0.03). A real mistake moves outputs by far more."""
    slack = 0.0
    if want.dtype in HALF_DTYPES and want.numel():
        slack = ULP_SLACK * torch.finfo(want.dtype).eps * float(want.abs().nan_to_num(
            nan=0.0, posinf=0.0, neginf=0.0).max())
    got, want = got.double(), want.double()
    diff = (got - want).abs()
    both_nan = got.isnan() & want.isnan()
    diff = torch.where(both_nan, torch.zeros_like(diff), diff)
    max_abs = float(diff.max()) if diff.numel() else 0.0
    rel = diff / want.abs().clamp_min(1e-12)
    max_rel = float(rel.max()) if rel.numel() else 0.0
    ok = bool(torch.allclose(got, want, rtol=rtol, atol=atol + slack, equal_nan=True))
    return ok, max_abs, max_rel


@dataclass(frozen=True)
class Tolerance:
    """How close replay must come to eager: rtol/atol for computed outputs; for picked ids
    (`picks`: argmax, top-k ids) the share of rows whose ids may differ."""

    rtol: float
    atol: float
    picks: frozenset = frozenset()
    picked_rows: float = 0.0

    @classmethod
    def of(cls, spec) -> "Tolerance":
        v = spec.capture.verify
        return cls(v.rtol, v.atol, frozenset(n for n, o in spec.outputs.items() if o.picks_ids),
                   v.picked_rows)


def compare_picks(got: torch.Tensor, want: torch.Tensor, tol: Tolerance) -> tuple[bool, int, int]:
    """(close, rows that differ, rows): a near tie of scores may swap a pick under capture,
    so up to tol.picked_rows of the rows (at least one) may differ."""
    rows = got.shape[0] if got.dim() else 1
    differ = int((got.reshape(rows, -1) != want.reshape(rows, -1)).any(dim=1).sum())
    return differ <= allowed_picks(tol.picked_rows, rows), differ, rows


def fill_verify_batch(bucket: Bucket, inputs: dict[str, torch.Tensor],
                      specs: dict[str, InputSpec]) -> torch.Generator:
    """The bucket's synthetic verification batch into its static input views (the same on every
    lane); the generator then draws the padded rows' other values."""
    gen = torch.Generator().manual_seed(1234 + bucket.volume)
    fill_synthetic(inputs, specs, gen)
    return gen


def verify_bucket(bucket: Bucket, run: Callable[[], None], reference: dict[str, torch.Tensor],
                  inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor],
                  specs: dict[str, InputSpec], tol: Tolerance,
                  positions: "Positions | None" = None) -> VerifyResult:
    """Check one lane's replay (`run`) on the verification batch against the bucket's eager
    `reference` outputs on that batch, and pad isolation: two replays, no eager run. With
    positions (the bucket's first lane): padded positions too (verify_positions)."""
    gen = fill_verify_batch(bucket, inputs, specs)
    run()
    replayed = {n: t.clone() for n, t in outputs.items()}
    check = compare_outputs(replayed, reference, tol, "")
    result = VerifyResult(**check.model_dump())
    if bucket.batch > 1:
        real = bucket.batch // 2
        fill_synthetic(inputs, specs, gen, rows=slice(real, None))
        run()
        moved = [n for n, t in outputs.items()
                 if not compare(t[:real], replayed[n][:real], tol.rtol, tol.atol)[0]]
        result.pad_isolated = not moved
        if moved:
            result.passed = False
            result.failures.append(
                f"padded rows change real rows of output(s) {', '.join(moved)}: the model mixes "
                "rows of the batch (e.g. batch norm in training mode, or attention across the "
                "batch), so it cannot be padded to buckets")
    if positions is not None and result.passed:
        moved = verify_positions(bucket, run, inputs, outputs, specs, positions, tol)
        result.pad_positions = None if moved is None else not moved
        if moved:
            axes = " and ".join(a for a in bucket.axes[1:] if bucket.size(a) > 1)
            result.passed = False
            result.failures.append(
                f"padded positions change real records' output(s) {', '.join(moved)}: a record "
                f"padded along {axes} gives other values than the same record unpadded, so the "
                "model reads the positions past a record's length (a mean, sum or attention "
                "over them without a mask, or a mask input whose pad is not the value the "
                "model masks)")
    return result


@dataclass(frozen=True)
class Positions:
    """What the padded-positions check needs beside the lane's buffers: the outputs' spec
    shapes (names are bucket axes) and the model called eagerly on inputs of any shape."""

    output_dims: dict[str, list]
    eager: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def verify_positions(bucket: Bucket, run: Callable[[], None], inputs: dict[str, torch.Tensor],
                     outputs: dict[str, torch.Tensor], specs: dict[str, InputSpec],
                     positions: Positions, tol: Tolerance) -> list[str] | None:
    """Padded positions: the first rows (half the batch, at least one) get their inputs' pad
    value past half of every axis but batch, as a record of that length is padded; the replay's
    outputs for them, cut to that length, must equal the model's eager outputs on the inputs
    cut there (the records unpadded). The outputs that differ; None where there is no axis to
    pad or the model cannot run the shorter shape (nothing is claimed)."""
    short = {a: bucket.size(a) // 2 for a in bucket.axes[1:] if bucket.size(a) > 1}
    if not short:
        return None
    real = max(1, bucket.batch // 2)

    def cut(t: torch.Tensor, dims: list) -> tuple:  # [:real], and [:length] along each axis
        at = [slice(0, real)] + [slice(None)] * (t.dim() - 1)
        for k, d in enumerate(dims[1:], 1):
            if d in short:
                at[k] = slice(0, short[d])
        return tuple(at)

    for name, t in inputs.items():
        dims = specs[name].shape
        for k, d in enumerate(dims[1:], 1):
            if d in short:  # each padded axis's positions, whatever the others hold
                at = [slice(0, real)] + [slice(None)] * (t.dim() - 1)
                at[k] = slice(short[d], None)
                t[tuple(at)] = specs[name].pad
    unpadded = {n: t[cut(t, specs[n].shape)].clone() for n, t in inputs.items()}
    run()
    padded = {n: t[cut(t, positions.output_dims[n])] for n, t in outputs.items()}
    try:
        alone = positions.eager(unpadded)
    except Exception:  # noqa: BLE001 - a model that runs only the buckets' shapes
        return None
    moved = []
    for name, got in padded.items():
        want = alone.get(name)
        if want is None or tuple(want.shape) != tuple(got.shape):
            return None  # not shaped as the check can compare: claim nothing
        if name in tol.picks:
            if not compare_picks(got, want.to(got.device, got.dtype), tol)[0]:
                moved.append(name)
        elif not compare(got, want.to(got.device, got.dtype), tol.rtol, tol.atol)[0]:
            moved.append(name)
    return moved


def verify_real_batch(eager: Callable[[], None], outputs: dict[str, torch.Tensor],
                      tol: Tolerance) -> BatchCheck:
    """Right after a replay of a real batch: eager on the same static inputs; the outputs must
    agree. The eager results are left in the static outputs (equal within tolerance)."""
    replayed = {n: t.clone() for n, t in outputs.items()}
    eager()
    return compare_outputs(replayed, outputs, tol, "on the first real batch, ")


def compare_outputs(replayed: dict[str, torch.Tensor], eager: dict[str, torch.Tensor],
                    tol: Tolerance, when: str) -> BatchCheck:
    """The replay's outputs against eager's, output by output."""
    result = BatchCheck(passed=True, max_abs_err=0.0, max_rel_err=0.0)
    for name, t in eager.items():
        got = replayed[name]  # the reference may wait in host memory for a later lane
        if name in tol.picks:
            ok, differ, rows = compare_picks(got, t.to(got.device), tol)
            if not ok:
                result.passed = False
                result.failures.append(
                    f"output {name!r}: {when}replay picks other ids than eager in {differ} of "
                    f"{rows} rows (picked_rows={tol.picked_rows:g} allows "
                    f"{allowed_picks(tol.picked_rows, rows)})")
            continue
        rtol, atol = tol.rtol, tol.atol
        ok, max_abs, max_rel = compare(got, t.to(got.device), rtol, atol)
        result.max_abs_err = max(result.max_abs_err, max_abs)
        result.max_rel_err = max(result.max_rel_err, max_rel)
        if not ok:
            result.passed = False
            result.failures.append(
                f"output {name!r}: {when}replay differs from eager (max abs error "
                f"{max_abs:.3g}, max relative error {max_rel:.3g}; rtol={rtol:g}, atol={atol:g})")
    return result


ROW_REMEDIES = (
    "fix the model so that each row of a batch is computed from that row alone (batch norm in "
    "eval mode; attention, pooling and sums within a record)",
    "or run one record per batch, unpadded: buckets.batch: [1] and data.batch_size: 1 (slow)")
POSITION_REMEDIES = (
    "mask the padded positions in the model: an attention mask input (pad: 0) that its "
    "attention and pooling honour",
    "or give the input that marks them the pad value the model ignores (inputs.<name>.pad)",
    "or, where the check's random inputs are ones your data never holds (a length input "
    "pointing past a record's own length), set capture.verify.positions: false")


def verify_remedies(result: VerifyResult, *, captured: bool,
                    on_failure: str) -> tuple[str, list[str]]:
    """(a note, the numbered remedies) for a failed verification: only those that work for
    what failed. Padded rows moving real rows is the model's doing, and eager runs pad to the
    same buckets, so capture.on_failure: eager cannot help there; nor can it where the bucket
    already ran eagerly (the CPU, capture.backend: eager)."""
    differs = any("replay differs from eager" in f for f in result.failures)
    if differs and not captured:  # the model differs from itself: that moves padded rows too
        return "", ["make forward deterministic: the same inputs must give the same outputs "
                    "on every call (no dropout or random ops, no state kept between calls)",
                    "loosen capture.verify.rtol / atol if the differences are rounding"]
    padding = (("records", POSITION_REMEDIES) if result.pad_positions is False else
               ("batches", ROW_REMEDIES) if result.pad_isolated is False else None)
    if padding is not None:
        what, remedies = padding
        note = (f"; capture.on_failure: eager does not help here: eager runs pad their {what} "
                "to the same buckets" if on_failure == "eager" else "")
        return note, list(remedies)
    return "", ["loosen capture.verify.rtol / atol if the differences are rounding",
                "set capture.on_failure: eager (the bucket runs eagerly; recorded in the "
                "manifest)"]
