"""The graph table's mechanics, shared by both kinds of job: a forward pass (capture.py, its
verification in verify.py) and generation (generate/graphs.py, with its own verification).

Each kind makes its steps (a closure over its static buffers) and checks them; what a step's
set-up does beside that is here, once (GraphPool):
- warm-up on a side stream: lazy init, cuBLAS workspaces, autotuning and torch.compile's
  compilation happen there, outside the capture, so the capture stream starts clean;
- capture into the job's one memory pool, largest first: the smaller graphs fit in the blocks
  the largest one left, which is why one pool costs about as much as the largest graph alone.
  A failed capture leaves its pool marked as being recorded to, so later graphs go to a new
  one;
- the memory budget (capture.memory_budget_mib): what the graphs took so far, and whether one
  more would pass it;
- eager fallback: a graph that cannot be used (its capture failed, it passes the budget, it
  disagrees with eager) is set aside and its step runs eagerly, the kind recording the reason.
  A graph set aside stays alive: freeing it would release blocks of the shared pool that
  later graphs were captured into.

Every step set up is a Graph (vLLM's CUDAGraphEntry): its eager step, its graph where
captured, what verification found, and `run`, which replays the graph or runs the step. How a
key of either kind's table was set up (captured or eager and why, its costs) is a SetUp: a
forward pass's bucket across its lanes (capture.BucketState), a generation step
(generate/graphs.StepGraph).
"""

from __future__ import annotations

import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from graphrun.base.errors import CaptureError, GraphrunError, error_chain, first_message
from graphrun.base.units import MiB


@dataclass
class Graph:
    """One step set up: how to run it, and what verification found (the kind's result)."""

    step: Callable[[], None]  # the eager step on the static buffers
    graph: "torch.cuda.CUDAGraph | None" = None
    verify: Any = None
    check_real: bool = False  # a forward pass's first real batch still to be checked
    run: Callable[[], None] = field(init=False)  # graph.replay, or the eager step

    def __post_init__(self) -> None:
        self.run = self.graph.replay if self.graph is not None else self.step

    def use(self, graph: "torch.cuda.CUDAGraph") -> None:
        self.graph, self.run = graph, graph.replay

    def to_eager(self) -> None:
        self.graph, self.run, self.check_real = None, self.step, False


@dataclass(kw_only=True)
class SetUp:
    """How one key of a graph table was set up: the manifest's status and reason, its costs."""

    status: str = "pending"  # captured | eager; a forward pass's also skipped | unused
    reason: str | None = None
    set_up: str | None = None  # setup | first_use (capture.lazy), None while not set up
    capture_s: float | None = None
    memory_bytes: int | None = None


class GraphPool:
    """The side stream warm-ups run on, the memory pool graphs are captured into and the
    budget they take from, for one job on one device.

    graphs: the backend captures (cuda-graph); shared: one pool for every graph (else each
    capture takes a pool of its own); pool: a pool handle to capture into, else a new one;
    budget_bytes: what the graphs may take (None: no limit)."""

    def __init__(self, device: torch.device, *, graphs: bool, shared: bool = True, pool=None,
                 budget_bytes: int | None = None):
        self.device, self.graphs, self.shared = device, graphs, shared
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pool = ((pool if pool is not None else torch.cuda.graph_pool_handle())
                     if graphs and shared else None)
        self.budget, self.spent = budget_bytes, 0  # spent: the pool growth of the captures
        self.retired: list[torch.cuda.CUDAGraph] = []  # set aside, kept alive (docstring)

    @contextmanager
    def side_stream(self) -> Iterator[None]:
        """Run the block on the side stream, after the work queued before it; the device
        is idle again when it ends."""
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)
        torch.cuda.synchronize(self.stream.device)

    def warm_up(self, step: Callable[[], None], iters: int) -> float:
        """`iters` eager runs before capture (on the side stream on CUDA); their seconds."""
        t0 = time.perf_counter()
        if self.stream is None:
            for _ in range(iters):
                step()
            return time.perf_counter() - t0
        with self.side_stream():
            for _ in range(iters):
                step()
        return time.perf_counter() - t0

    @property
    def eager_reason(self) -> str:
        """Why nothing is captured, where the backend is eager."""
        return "backend eager" if self.device.type == "cuda" else "no CUDA device: backend eager"

    def capture(self, step: Callable[[], None], name: str, *, first_use: bool = False,
                into=None) -> tuple[torch.cuda.CUDAGraph, float, int]:
        """One run of `step` captured into `into` (a graph's pool), else the job's pool: the
        graph, the seconds it took and the pool growth, which counts as spent. A failed
        capture raises CaptureError, the job's pool then replaced (module docstring).
        first_use: set up mid-stream, while other threads (a reader, a writer) may make CUDA
        calls, so the capture is thread-local."""
        try:
            graph, seconds, grown = capture_graph(
                step, name, stream=self.stream, pool=self.pool if into is None else into,
                mode="thread_local" if first_use else "global")
        except CaptureError:
            if into is None and self.pool is not None:
                self.pool = torch.cuda.graph_pool_handle()
            raise
        self.spent += grown
        return graph, seconds, grown

    def room_for(self, step: Callable[[], None]) -> tuple[bool, int]:
        """Before a capture: whether the graph of `step` would keep the graphs within the
        budget, estimated from one eager run's peak; and that estimate, in bytes."""
        need = peak_step_bytes(step, self.device)
        # in a shared pool, smaller graphs reuse the largest captured one's blocks
        total = max(self.spent, need) if self.shared else self.spent + need
        return self.budget is None or total <= self.budget, need

    def past_budget(self) -> str | None:
        """After a capture: why the graphs now take too much, or None within the budget."""
        if self.budget is None or self.spent <= self.budget:
            return None
        return (f"would take the graphs to {self.spent / MiB:.1f} MiB, past "
                f"memory_budget_mib={self.budget / MiB:g}")

    def set_aside(self, entry: Graph) -> None:
        """The entry's graph kept alive but unused: its step runs eagerly from now on."""
        if entry.graph is not None:
            self.retired.append(entry.graph)
        entry.to_eager()

    def fall_back(self, key: SetUp, graphs: Iterable[Graph], reason: str) -> None:
        """The key runs eagerly from now on, with the reason: its graphs set aside."""
        for entry in graphs:
            self.set_aside(entry)
        key.status, key.reason = "eager", reason

    def close(self) -> None:
        self.pool = None
        self.retired.clear()


def peak_step_bytes(step: Callable[[], None], device: torch.device) -> int:
    """Memory one eager run takes beyond what is allocated already: the graph's pool estimate."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def capture_graph(step: Callable[[], None], name: str, *, stream: torch.cuda.Stream,
                  pool, mode: str = "global") -> tuple[torch.cuda.CUDAGraph, float, int]:
    """Capture one run of `step` (named `name` in errors: its bucket or size); return the
    graph, the seconds it took and the pool growth. mode: the capture error mode;
    thread_local while other threads may make CUDA calls."""
    device = stream.device
    torch.cuda.synchronize(device)
    # Reserved memory only grows by the segments this graph's private pool takes: the general
    # pool's cached blocks are not usable inside a capture. (torch.cuda.graph would also empty
    # the cache before every capture, which makes the next warm-up allocate afresh.)
    before = torch.cuda.memory_reserved(device)
    graph = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        graph.capture_begin(*(() if pool is None else (pool,)), capture_error_mode=mode)
        try:
            step()
        except GraphrunError:
            _end_failed_capture(graph, device)
            raise
        except Exception as exc:  # noqa: BLE001 - any failure inside capture is explained
            _end_failed_capture(graph, device)
            raise explain_capture_failure(exc, name) from exc
        try:
            graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - e.g. an op the capture invalidated
            _end_failed_capture(graph, device)
            raise explain_capture_failure(exc, name) from exc
    torch.cuda.synchronize(device)
    return graph, time.perf_counter() - t0, torch.cuda.memory_reserved(device) - before


def _end_failed_capture(graph: torch.cuda.CUDAGraph, device: torch.device) -> None:
    """End a capture that failed (ending it raises: it was invalidated) and clear what a failed
    capture leaves on the stream, so the next graph, or eager, can run."""
    try:
        graph.capture_end()
    except Exception:  # noqa: BLE001 - the original error is what the user needs to see
        pass
    _recover_after_failed_capture(device)


def _recover_after_failed_capture(device: torch.device) -> None:
    """A failed capture can leave a sticky error on the stream; clear what can be cleared.
    It also leaves the device's random generator marked as capturing (the capture's end never
    ran), after which every random op on the device raises: give it a fresh state of the same
    seed and offset."""
    try:
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - the original error is what the user needs to see
        pass
    index = device.index if device.index is not None else torch.cuda.current_device()
    gen = torch.cuda.default_generators[index]
    if hasattr(gen, "graphsafe_set_state"):  # torch >= 2.4
        gen.graphsafe_set_state(gen.clone_state())


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


def explain_capture_failure(exc: BaseException, name: str) -> CaptureError:
    """A capture error that names the bucket, the model line that failed and what to do.

    If the error came with others chained to it (as __context__ or __cause__), the one raised
    in the model's own code is the one that says what the model did: report that one.
    """
    chain = error_chain(exc)
    where = next((w for w in map(model_frame, chain) if w), None)
    cause = next((e for e in chain if model_frame(e)), chain[-1])
    first = first_message(cause)
    text = f"CUDA graph capture failed: {type(cause).__name__}: {first}"
    if where:
        text += f"\n  at {where}"
    return CaptureError(text, bucket=name, remedies=REMEDIES)


def model_frame(exc: BaseException) -> str | None:
    """The innermost frame outside torch and graphrun: the model's own line, where it failed."""
    torch_dir = str(Path(torch.__file__).parent)
    own_dir = str(Path(__file__).parents[1])
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename.startswith((torch_dir, own_dir)) or frame.filename.startswith("<"):
            continue
        found = f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return found
