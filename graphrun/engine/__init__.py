"""The engine: a model's static buffers and captured graphs, and batches run through them.

    buffers.py  static buffers at the largest bucket, a view per bucket
    lanes.py    a Lane: its static buffers, its graph per bucket, its free event
    capture.py  warm-up on a side stream, capture largest first into one pool, failures explained
    verify.py   replay == eager and pad isolation, per lane (manifest.VerifyResult)
    launch.py   the file path: host slots, copy streams, a launch and its handle (Launch.result())
    direct.py   run_batch's path: one synchronous call on the caller's stream
    inputs.py   run_batch's inputs checked as a file's records are
    timing.py   per-batch phase timings (CUDA events on a GPU)
    runner.py   the public Runner: load, capture, run_batch
"""

from graphrun.engine.runner import Runner

__all__ = ["Runner"]
