"""A bucket probed outside a run (`graphrun bench`, the planner's memory budget): a seeded
synthetic batch that fills it, and what each bucket of a Runner cost to set up."""

from __future__ import annotations

import numpy as np

from graphrun.spec.keys import FLOAT_DTYPES, PipelineSpec


def synthetic_batch(spec: PipelineSpec, sizes: dict[str, int], seed: int) -> dict:
    """One batch filling the bucket: [batch, *dims] per input, seeded."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, inp in spec.inputs.items():
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in inp.shape)
        if inp.dtype == "bool":
            a = rng.integers(0, 2, shape).astype(bool)
        elif inp.dtype in FLOAT_DTYPES:
            a = rng.standard_normal(shape).astype(np.float32)
        else:
            lo, hi = inp.range if inp.range else (0, 2)
            a = rng.integers(int(lo), int(hi), shape).astype(np.int64)
        out[name] = a
    return out


def bucket_costs(runner) -> dict[str, dict]:
    """Per bucket name: status, capture time, memory, verify (every lane's graph passed; the
    one place that reads the runner's buckets)."""
    out = {}
    for b in runner.bucket_reports():
        checks = [lane.verify.passed for lane in b.lanes if lane.verify is not None]
        out[b.name] = {"status": b.status, "capture_s": b.capture_s,
                       "memory_bytes": b.memory_bytes, "verify": all(checks) if checks else None}
    return out
