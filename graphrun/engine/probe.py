"""A bucket probed outside a run (`graphrun bench`, the planner's memory budget): a seeded
synthetic batch that fills it, and what each bucket of a Runner cost to set up."""

from __future__ import annotations

import numpy as np
import torch

from graphrun.engine.verify import synthetic_values
from graphrun.spec.keys import PipelineSpec


def synthetic_batch(spec: PipelineSpec, sizes: dict[str, int], seed: int
                    ) -> dict[str, np.ndarray]:
    """One batch filling the bucket: [batch, *dims] per input, seeded (verify's values)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: synthetic_values(inp.dtype, inp.range, [sizes.get(d, d) for d in inp.shape],
                                   gen).numpy()
            for name, inp in spec.inputs.items()}


def bucket_costs(runner) -> dict[str, dict]:
    """Per bucket name: status, capture time, memory, verify (every lane's graph passed; the
    one place that reads the runner's buckets)."""
    out = {}
    for b in runner.bucket_reports():
        checks = [lane.verify.passed for lane in b.lanes if lane.verify is not None]
        out[b.name] = {"status": b.status, "capture_s": b.capture_s,
                       "memory_bytes": b.memory_bytes, "verify": all(checks) if checks else None}
    return out
