"""Capture: one CUDA graph per bucket, largest first, into one shared memory pool.

Per bucket: `warmup_iters` eager runs on a side stream (lazy init, cuBLAS workspaces, autotuning
and torch.compile's compilation happen there, outside the capture), then one run captured into a
CUDAGraph. The step that is captured reads the static input views and copies the model's returns
into the static output views, so a replay leaves its results at fixed addresses that no other
graph's pool memory can overlap. Captured largest first, the smaller graphs fit in the blocks the
largest one left in the shared pool, which is why one pool costs about as much as the largest
bucket alone.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .buckets import Bucket
from .errors import CaptureError, GraphrunError, ModelError
from .models.load import call_model, name_outputs

MiB = 1 << 20


@dataclass
class BucketState:
    """What the runner knows about one bucket: how to run it, and what it cost."""

    bucket: Bucket
    status: str = "pending"  # captured | eager | skipped
    reason: str | None = None
    graph: torch.cuda.CUDAGraph | None = None
    run: Callable[[], None] | None = None  # graph.replay, or the eager step
    check_real: bool = False  # verify the replay of the first real batch against eager
    # The overlapped stream's second lane (Runner.add_lane): the bucket captured again on
    # lane 1's static buffers, replayed in turn with the first graph. None: lane 0 only.
    twin: torch.cuda.CUDAGraph | None = None
    twin_check_real: bool = False
    warmup_s: float | None = None
    capture_s: float | None = None
    memory_bytes: int | None = None
    verify: dict | None = None
    eager_us: float | None = None
    replay_us: float | None = None
    stats: dict = field(default_factory=lambda: {"batches": 0, "records": 0, "padded_rows": 0})
    launches: int = 0  # batches launched: which are timed (timing.sampled)


def make_step(model: torch.nn.Module, call: str, inputs: dict[str, torch.Tensor],
              outputs: dict[str, torch.Tensor],
              model_dtypes: dict[str, torch.dtype] | None = None,
              rounding: dict[str, torch.dtype] | None = None) -> Callable[[], None]:
    """The unit that is warmed up, captured and replayed: static inputs -> static outputs.

    An input whose static buffer is staged in another dtype than the model takes (bfloat16 is
    staged as float32, since numpy has none) is cast here, inside the graph, so the copy from
    the host stays a plain copy instead of a copy plus a conversion kernel launched per batch.
    Outputs likewise: `rounding` names those whose values are of a dtype (bfloat16) that their
    static buffer holds as another (float32); they are rounded to it first, where the model
    gives a wider one.
    """
    names = list(outputs)
    casts = {n: d for n, d in (model_dtypes or {}).items() if inputs[n].dtype != d}
    rounding = rounding or {}

    def step() -> None:
        args = {n: t.to(casts[n]) if n in casts else t for n, t in inputs.items()}
        with torch.inference_mode():
            got = name_outputs(call_model(model, args, call), names)
        for name, t in got.items():
            dst = outputs[name]
            if t.shape != dst.shape:
                raise ModelError(output_shape_problem(name, list(t.shape), list(dst.shape)))
            if name in rounding and t.dtype != rounding[name]:
                t = t.to(rounding[name])
            dst.copy_(t)

    return step


def output_shape_problem(name: str, got: list[int], want: list[int]) -> str:
    """What is wrong when a model's output does not fit its static buffer: the batch
    dimension is the model's to keep (one row per input row), the others the spec's to say."""
    head = (f"output {name!r} has shape {got} but the spec's outputs.{name}.shape gives "
            f"{want} for this bucket")
    if not got or got[0] != want[0]:
        rows = got[0] if got else "no"
        return (f"{head}: the model returned {rows} rows for a batch of {want[0]}; the model "
                "must return one row per input row along dimension 0 (a reduction or an "
                "indexing over the batch, such as x[0] or x.mean(0), drops it); fix the "
                "model's forward, not the spec")
    return f"{head}; fix outputs.{name}.shape (a name in it is a bucket axis)"


def warm_up(step: Callable[[], None], iters: int, stream: torch.cuda.Stream | None) -> float:
    """Eager runs before capture, on a side stream on CUDA so the capture stream starts clean."""
    t0 = time.perf_counter()
    if stream is None:
        for _ in range(iters):
            step()
        return time.perf_counter() - t0
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        for _ in range(iters):
            step()
    torch.cuda.current_stream(stream.device).wait_stream(stream)
    torch.cuda.synchronize(stream.device)
    return time.perf_counter() - t0


def peak_step_bytes(step: Callable[[], None], device: torch.device) -> int:
    """Memory one eager run takes beyond what is allocated already: the bucket's pool estimate."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def capture_graph(step: Callable[[], None], bucket: Bucket, *, stream: torch.cuda.Stream,
                  pool) -> tuple[torch.cuda.CUDAGraph, float, int]:
    """Capture one run of `step`; return the graph, the seconds it took and the pool growth."""
    device = stream.device
    torch.cuda.synchronize(device)
    # Reserved memory only grows by the segments this graph's private pool takes: the general
    # pool's cached blocks are not usable inside a capture. (torch.cuda.graph would also empty
    # the cache before every capture, which makes the next bucket's warm-up allocate afresh.)
    before = torch.cuda.memory_reserved(device)
    graph = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        graph.capture_begin(*(() if pool is None else (pool,)), capture_error_mode="global")
        try:
            step()
        except GraphrunError:
            _end_failed_capture(graph, device)
            raise
        except Exception as exc:  # noqa: BLE001 - any failure inside capture is explained
            _end_failed_capture(graph, device)
            raise explain_capture_failure(exc, bucket) from exc
        try:
            graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - e.g. an op the capture invalidated
            _end_failed_capture(graph, device)
            raise explain_capture_failure(exc, bucket) from exc
    torch.cuda.synchronize(device)
    return graph, time.perf_counter() - t0, torch.cuda.memory_reserved(device) - before


def _end_failed_capture(graph: torch.cuda.CUDAGraph, device: torch.device) -> None:
    """End a capture that failed (ending it raises: it was invalidated) and clear what a failed
    capture leaves on the stream, so the next bucket, or eager, can run."""
    try:
        graph.capture_end()
    except Exception:  # noqa: BLE001 - the original error is what the user needs to see
        pass
    _recover_after_failed_capture(device)


def _recover_after_failed_capture(device: torch.device) -> None:
    """A failed capture can leave a sticky error on the stream; clear what can be cleared."""
    try:
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - the original error is what the user needs to see
        pass


REMEDIES = [
    "remove host synchronisations from forward: .item(), .tolist(), .cpu(), .numpy(), print() "
    "of a tensor, and Python `if` on a tensor's value (use torch.where instead)",
    "create tensors on the model's device (device=x.device) or register constants as buffers; "
    "a CPU tensor cannot take part in a graph",
    "keep shapes static: no nonzero(), masked_select(), boolean-mask indexing or unique() "
    "whose output size depends on the data",
    "set capture.on_failure: eager to run this bucket eagerly (recorded in the manifest), or "
    "capture.backend: eager to run every bucket eagerly",
]


def explain_capture_failure(exc: BaseException, bucket: Bucket) -> CaptureError:
    """A capture error that names the bucket, the model line that failed and what to do.

    If the error came with others chained to it (as __context__ or __cause__), the one raised
    in the model's own code is the one that says what the model did: report that one.
    """
    chain = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__context__ or exc.__cause__
    where = next((w for w in map(_model_frame, chain) if w), None)
    cause = next((e for e in chain if _model_frame(e)), chain[-1])
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    text = f"CUDA graph capture failed: {type(cause).__name__}: {first}"
    if where:
        text += f"\n  at {where}"
    return CaptureError(text, bucket=bucket.name, remedies=REMEDIES)


def model_failed(exc: BaseException, bucket: str, where: str, ids: list) -> ModelError:
    """The model raised on a batch of the stream: name the batch (its first record's place in
    the input, its ids), the bucket, and the model's own error line, without a traceback."""
    chain = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__context__ or exc.__cause__
    at = next((w for w in map(_model_frame, chain) if w), None)
    cause = next((e for e in chain if _model_frame(e)), chain[0])
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    shown = ", ".join(map(str, ids[:3])) + (f", ... {ids[-1]}" if len(ids) > 3 else "")
    text = (f"the model raised on the batch of {len(ids)} records from {where} (ids {shown}) "
            f"in bucket {bucket}: {type(cause).__name__}: {first}")
    if at:
        text += f"\n  at {at}"
    return ModelError(text + "\n  the batches before it are committed: fix the model, then "
                      "run again with --resume to continue from this batch (--debug shows the "
                      "traceback)")


def _model_frame(exc: BaseException) -> str | None:
    """The innermost frame outside torch and graphrun: the model's own line, where it failed."""
    torch_dir = str(Path(torch.__file__).parent)
    own_dir = str(Path(__file__).parent)
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename.startswith((torch_dir, own_dir)) or frame.filename.startswith("<"):
            continue
        found = f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return found
