"""What a decode step launches after the model's logits: the pick and the bookkeeping, counted
on the CPU (no GPU needed). torch's ops that compute are counted as they are dispatched (views
and empty tensors left out); with --kernels a stand-in takes the Triton kernels' launches
(generate/pick_kernels.py) and counts them, as a GPU would run them.

    python benchmarks/count_step_ops.py [--kernels] [--root TREE] [--vocab 3000] [--rows 4]
        [--list]

--root: import graphrun from another tree (a `git archive` of an older commit) to compare.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

VIEWS = {"slice", "unsqueeze", "view", "select", "expand", "alias", "as_strided", "t",
         "transpose", "detach", "squeeze", "_unsafe_view", "empty", "empty_like", "new_empty"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", action="store_true",
                    help="count the Triton kernels' launches through a stand-in")
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--vocab", type=int, default=3000)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--list", action="store_true", help="name each op counted")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(a.root))

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from graphrun.generate import GenerateConfig, sampling, steps
    from graphrun.generate.config import Sampling
    from graphrun.models.causal.kv_cache import KVLayout, PagedCache

    launches: collections.Counter = collections.Counter()

    class Launch:  # kernel[grid](*args): counted, nothing computed
        def __init__(self, name: str):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.update([self.name])

    class Kernels:
        def __getattr__(self, name: str) -> Launch:
            return Launch(name)

    if a.kernels:
        sampling.SWITCH.__dict__["kernels"] = Kernels()  # the cached module, stood in for
        sampling.SWITCH.on = lambda device: True
        sampling._kernel_takes = lambda x: True

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket).split(".")[-1]
            if name not in VIEWS:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    rows, vocab, cpu = a.rows, a.vocab, torch.device("cpu")
    print(f"# count_step_ops: {a.root}, {rows} rows, {vocab} columns, "
          f"{'kernels stood in' if a.kernels else 'torch ops only'}")
    for method in ("greedy", "sample"):
        launches.clear()
        sampling_cfg = (Sampling(method="sample", temperature=1.0, top_p=1.0, seed=0)
                        if method == "sample" else Sampling(method="greedy"))
        cfg = GenerateConfig(max_new_tokens=8, eos_ids=(1,), sampling=sampling_cfg)
        variant = steps.Variant(sample=method == "sample")
        state = steps.SlotState(rows, 4, 16, 2, cfg, vocab, cpu, num_blocks=8, block_size=4,
                                variant=variant)
        cache = PagedCache(KVLayout(1, 2, 2, 8), 8, 4, torch.float32, cpu)
        logits = torch.randn(rows, vocab)
        step = steps.decode_step(lambda t, p, kv: logits, state, cache, cfg, rows, variant)
        with Count() as c:
            step()
        print(f"{method:6s} torch ops that compute: {sum(c.ops.values()):3d}  kernel launches: "
              f"{sum(launches.values())}  {dict(launches) or ''}")
        if a.list:
            print("       ", dict(c.ops))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
