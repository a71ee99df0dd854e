"""The engine: a model's static buffers and captured graphs, and batches run through them.

    buffers.py  static buffers at the largest bucket, a view per bucket
    lanes.py    a Lane: its static buffers, its graph per bucket, its free event
    graphs.py   graph set-up both kinds of job share: side-stream warm-up, capture into one
                pool, the memory budget, graphs set aside for eager, failures explained
    capture.py  a forward pass's capture per bucket and lane, largest first, its fallbacks
    verify.py   replay == eager and pad isolation, per lane (manifest.VerifyResult)
    launch.py   the file path: host slots, copy streams, a launch and its handle (Launch.result())
    direct.py   run_batch's path: one synchronous call on the caller's stream
    inputs.py   run_batch's inputs checked as a file's records are
    timing.py   per-batch phase timings (CUDA events on a GPU)
    runner.py   the public Runner: load, capture, run_batch
"""

__all__ = ["Runner"]


def __getattr__(name):
    if name == "Runner":  # imported on first use: a generation job's steps need none of it
        from graphrun.engine.runner import Runner

        return Runner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
