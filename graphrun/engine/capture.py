"""Capture of a forward pass: one CUDA graph per bucket and lane, largest first, into one pool.

Per bucket: `warmup_iters` eager runs on the side stream, then one run captured (the shared
mechanics: graphs.py's GraphPool), then verification against eager (verify.py). The step that
is captured reads the static input views and copies the model's returns into the static output
views, so a replay leaves its results at fixed addresses that no other graph's pool memory can
overlap. A forward pass adds lanes (a second set of static buffers, each captured bucket
captured again on it), buckets dropped before capture when they would pass the memory budget
(a smaller bucket takes their batches), capture.on_failure (error, or the bucket runs eagerly)
and capture.lazy's set-up on first use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection

import torch

from graphrun.engine.buckets import Bucket
from graphrun.base.errors import (CaptureError, GraphrunError, ModelError, error_chain,
                                  first_message)
from graphrun.base.phases import phase
from graphrun.base.units import MiB
from graphrun.models.call import call_model, index_hint, name_outputs
from graphrun.engine.graphs import Graph, GraphPool, SetUp, model_frame
from graphrun.engine.lanes import Lane, Layout
from graphrun.engine.padding import add_padded_positions
from graphrun.engine.verify import (Positions, Tolerance, fill_verify_batch, verify_bucket,
                                    verify_real_batch, verify_remedies)


@dataclass
class BucketState(SetUp):
    """One bucket across its lanes: how it was set up (graphs.SetUp; status also skipped by
    the budget, unused by capture.lazy), what it cost, its counts (lanes.py holds its graphs)."""

    bucket: Bucket
    first_use_batch: int | None = None  # set up on first use: the batch that needed it
    reference: dict | None = None  # eager outputs on the verification batch, for every lane
    pool: object = None  # the memory pool its graphs share, on every lane
    warmup_s: float | None = None
    eager_us: float | None = None
    replay_us: float | None = None
    stats: dict = field(default_factory=lambda: {"batches": 0, "records": 0, "padded_rows": 0})
    launches: int = 0  # batches launched: which are timed (timing.sampled)
    # its first real batch checked against eager, on one lane: every lane's graph is a capture
    # of the same step from the same verification batch, so one check stands for all
    real_checked: bool = False

    def count(self, n: int, lengths: dict | None = None) -> None:
        """A finished batch of n real rows in the counts; with the records' lengths per axis,
        its padded positions on each axis too."""
        self.stats["batches"] += 1
        self.stats["records"] += n
        self.stats["padded_rows"] += self.bucket.batch - n
        if lengths:
            add_padded_positions(self.stats, self.bucket, lengths, n)


class Capturer:
    """Warm-up, capture and verify of every bucket on a lane, largest first, into one pool.

    The first lane decides each bucket's status (captured, eager, skipped); a lane added later
    captures the buckets that are captured, into the pool their graphs already use, and a bucket
    whose capture or verification fails there only runs without that lane (a warning)."""

    def __init__(self, model, spec, device: torch.device, backend: str, layout: Layout, log):
        self.model, self.call, self.layout, self.log = model, spec.model.call, layout, log
        self.cap, self.input_specs, self.compiled = spec.capture, spec.inputs, spec.model.compile
        self.device, self.graphs = device, backend == "cuda-graph"
        budget = self.cap.memory_budget_mib
        self.pool = GraphPool(device, graphs=self.graphs, shared=self.cap.pool == "shared",
                              budget_bytes=budget * MiB if budget else None)
        self.tolerance = Tolerance.of(spec)
        self.output_dims = {n: o.shape for n, o in spec.outputs.items()}
        # an eager bucket has no replay to check: only capture.verify.eager checks the model
        self.verifies = self.cap.verify.enabled and (self.graphs or self.cap.verify.eager)

    def first_lane(self, lane: Lane, states: dict[Bucket, BucketState], table,
                   needed: Collection[Bucket] | None = None) -> None:
        """Every bucket, or with capture.lazy only those in `needed`: the others are left
        unused, to be set up on first use (first_use)."""
        todo = [b for b in table.all if needed is None or b in needed]
        for bucket in table.all:
            if bucket not in todo:
                states[bucket].status = "unused"
                states[bucket].reason = "capture.lazy: no batch selected it, so not set up"
        # each bucket's setup line says k/N: a long setup shows progress
        for k, bucket in enumerate(todo, 1):  # largest first: smaller graphs reuse its pool
            self._prepare(lane, states[bucket], table, f"{k}/{len(todo)}")
            if states[bucket].status != "skipped":  # memory_budget_mib dropped it: not set up
                states[bucket].set_up = "setup"

    def read_meanwhile(self, lane: Lane, states: dict[Bucket, BucketState], table,
                       seen: Collection[Bucket]) -> list[Bucket]:
        """capture.lazy: buckets of batches the reader held only after first_lane began (it
        reads on while setup runs), set up now as at setup rather than mid-stream on first use;
        returns them."""
        todo = [b for b in table.all if b in seen and states[b].status == "unused"]
        for k, bucket in enumerate(todo, 1):
            self._prepare(lane, states[bucket], table, f"{k}/{len(todo)}, read meanwhile")
            if states[bucket].status != "skipped":
                states[bucket].set_up = "setup"
        return todo

    def first_use(self, lanes: list[Lane], state: BucketState, table, batch: int) -> None:
        """capture.lazy: set up a bucket no batch selected before, on every lane, when batch
        number `batch` (0-based, this run's) needs it. The caller has waited for the device
        (no capture beside other work); other threads may still wait on finished events, so
        the capture is thread-local. A bucket the memory budget drops runs this batch eagerly;
        later batches pick other buckets, as after a drop at setup."""
        state.set_up, state.first_use_batch = "first_use", batch  # recorded if it fails too
        self._prepare(lanes[0], state, table, f"on first use by batch {batch}",
                      first_use=True)
        if state.status == "skipped":  # this batch is staged for it: run it eagerly, once
            lanes[0].graphs[state.bucket] = Graph(
                lanes[0].make_step(state.bucket, self.model, self.call, self.layout))
            state.status, state.reason = "eager", f"{state.reason}; ran eagerly on first use"
        for lane in lanes[1:]:
            if state.status == "captured":
                self._capture_on(lane, state, first_use=True)
        if state.status != "captured" or len(lanes) > 1:
            state.reference = None  # no other lane will compare against it

    def _prepare(self, lane: Lane, state: BucketState, table, nth: str,
                 first_use: bool = False) -> None:
        """Warm-up, capture and verify of one bucket; what the model raises there (a shape
        only this bucket has, say) is one located ModelError, never a traceback."""
        try:
            self._set_up(lane, state, table, nth, first_use)
        except GraphrunError:
            raise
        except Exception as exc:  # noqa: BLE001 - the model's own error, in this bucket
            hint = index_hint(self.model, self.input_specs) if isinstance(exc, IndexError) \
                else None
            raise setup_failed(exc, state.bucket.name, hint) from exc

    def _set_up(self, lane: Lane, state: BucketState, table, nth: str,
                first_use: bool) -> None:
        bucket = state.bucket
        step = lane.make_step(bucket, self.model, self.call, self.layout)
        if not self.graphs:
            self._prepare_eager(lane, state, step, nth)
            return
        with phase("warm-up", (bucket.name, lane.index)):
            state.warmup_s = self._warm_up(lane, state, step, max(self.cap.warmup_iters, 1))
        if not self._fits(state, step, table):
            return
        try:
            with phase("capture", (bucket.name, lane.index)):
                graph, state.capture_s, state.memory_bytes = self.pool.capture(
                    step, bucket.name, first_use=first_use)
        except CaptureError as err:
            lane.graphs[bucket] = Graph(step)
            self.fall_back([lane], state, err)
            return
        state.status, state.pool = "captured", graph.pool()
        self._verify_first(lane, state, Graph(step, graph))
        self.log(f"captured {bucket.name} ({nth}) in {state.capture_s * 1e3:.1f} ms")

    def _prepare_eager(self, lane: Lane, state: BucketState, step, nth: str) -> None:
        """Nothing is captured: no warm-up (torch.compile's kernels excepted: they compile in
        it) and no replay-vs-eager check, unless capture.verify.eager asks for the model's
        own checks (the same result twice, pad isolation), whose reference is one eager run."""
        bucket = state.bucket
        iters = self.cap.warmup_iters if self.compiled else 0
        if self.verifies:
            iters = max(iters, 1)
        if iters:
            with phase("warm-up", (bucket.name, lane.index)):
                state.warmup_s = self._warm_up(lane, state, step, iters)
        state.status = "eager"
        state.reason = self.pool.eager_reason + (
            "; checked as capture.verify.eager asks" if self.verifies else
            "; nothing captured, so no warm-up and no replay-vs-eager check")
        if self.verifies:
            self._verify_first(lane, state, Graph(step))
        else:
            lane.graphs[bucket] = Graph(step)
        self.log(f"set up {bucket.name} ({nth}, eager)")

    def _warm_up(self, lane: Lane, state: BucketState, step, iters: int) -> float:
        """Warm-up on the bucket's verification batch: its last eager run's outputs are the
        bucket's eager reference, which every lane's verification compares with."""
        fill_verify_batch(state.bucket, lane.inputs.views(state.bucket), self.input_specs)
        seconds = self.pool.warm_up(step, iters)
        if self.verifies:
            state.reference = {n: t.clone() for n, t in lane.outputs.views(state.bucket).items()}
        return seconds

    def _verify_first(self, lane: Lane, state: BucketState, entry: Graph) -> None:
        lane.graphs[state.bucket] = entry
        result = self._verify(lane, state, entry, first=True)
        if self.graphs and entry.graph is not None and state.reference is not None:
            # kept for a lane added later (host_slots), in host memory meanwhile
            state.reference = {n: t.cpu() for n, t in state.reference.items()}
        else:
            state.reference = None
        if result is not None and not result.passed:
            note, remedies = verify_remedies(result, captured=entry.graph is not None,
                                             on_failure=self.cap.on_failure)
            err = CaptureError("verification failed: " + "; ".join(result.failures) + note,
                               bucket=state.bucket.name, remedies=remedies)
            if entry.graph is None or False in (result.pad_isolated, result.pad_positions):
                raise err  # eager would pad alike
            self.fall_back([lane], state, err)

    def _verify(self, lane: Lane, state: BucketState, entry: Graph, first: bool = False):
        """The lane's replay against the bucket's eager reference on its verification batch,
        and on the bucket's first lane its padded positions (a property of the model, not of
        a lane); None with verify off."""
        if not self.verifies:
            return None
        bucket = state.bucket
        outputs = lane.outputs.views(bucket)
        positions = (Positions(self.output_dims, self._eager(list(outputs)))
                     if first and self.cap.verify.positions else None)
        with phase("verify", (bucket.name, lane.index)):
            entry.verify = verify_bucket(bucket, entry.run, state.reference,
                                         lane.inputs.views(bucket), outputs,
                                         self.input_specs, self.tolerance, positions)
        # an eager bucket needs no check against itself
        entry.check_real = entry.verify.passed and entry.graph is not None \
            and not state.real_checked
        return entry.verify

    def _eager(self, names: list[str]):
        """The model called eagerly on inputs of any shape: its outputs by name."""
        def call(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            with torch.inference_mode():
                return name_outputs(call_model(self.model, inputs, self.call), names)
        return call

    def _fits(self, state: BucketState, step, table) -> bool:
        """memory_budget_mib: a bucket whose pool would pass the budget is dropped, not run
        (a smaller bucket takes its batches)."""
        if self.pool.budget is None:
            return True
        fits, need = self.pool.room_for(step)
        if fits:
            return True
        state.status, state.reference = "skipped", None
        state.reason = (f"needs about {need / MiB:.1f} MiB; with {self.pool.spent / MiB:.1f} "
                        f"MiB already taken that passes memory_budget_mib="
                        f"{self.pool.budget / MiB:g}")
        table.drop(state.bucket)
        if not table.active:  # no bucket left to take a batch
            raise CaptureError(
                f"capture.memory_budget_mib drops every bucket: the last, "
                f"{state.bucket.name}, {state.reason}",
                bucket=state.bucket.name,
                remedies=["raise capture.memory_budget_mib, or remove it",
                          "add smaller buckets (buckets.batch), whose graphs take less"])
        self.log(f"warning: bucket {state.bucket.name} dropped: {state.reason}")
        return False

    def another_lane(self, lane: Lane, states: dict[Bucket, BucketState]) -> None:
        """Capture every captured bucket again on `lane`, into the pool its graphs use: the
        lanes replay one after the other on the compute stream, so they share its blocks. The
        time counts as the bucket's capture_s, the pool growth as its memory_bytes."""
        for state in states.values():
            if state.status == "captured":
                self._capture_on(lane, state)
            state.reference = None  # every lane has compared with it

    def _capture_on(self, lane: Lane, state: BucketState, first_use: bool = False) -> None:
        """A captured bucket's graph on one more lane, checked against its eager reference."""
        bucket = state.bucket
        step = lane.make_step(bucket, self.model, self.call, self.layout)
        name = f"bucket {bucket.name} runs without lane {lane.index}"
        try:
            with phase("warm-up", (bucket.name, lane.index)):
                self.pool.warm_up(step, 1)  # lazy state of new tensors, outside capture
            with phase("capture", (bucket.name, lane.index)):
                graph, seconds, grown = self.pool.capture(step, bucket.name,
                                                          first_use=first_use, into=state.pool)
        except GraphrunError as err:
            self.log(f"warning: {name}: its capture there failed: {err}")
            return
        state.capture_s = (state.capture_s or 0.0) + seconds
        state.memory_bytes = (state.memory_bytes or 0) + grown
        entry = Graph(step, graph)
        past = self.pool.past_budget()
        if past:
            self.pool.set_aside(entry)
            self.log(f"warning: {name}: its graph there {past}")
            return
        result = self._verify(lane, state, entry)
        if result is not None and not result.passed:
            self.pool.set_aside(entry)
            self.log(f"warning: {name}: its graph there failed verification: "
                     f"{'; '.join(result.failures)}")
            return
        lane.graphs[bucket] = entry

    def check_real(self, lanes: list[Lane], lane: Lane, state: BucketState) -> bool:
        """The first real batch of a captured bucket, right after its replay on a lane: eager
        on the same inputs (the lane's static outputs then hold eager's results). Once per
        bucket, whichever lane ran it. False when they disagree and the bucket fell back to
        eager; with on_failure: error, raises."""
        entry = lane.graphs[state.bucket]
        state.real_checked = True
        for other in lanes:
            if state.bucket in other.graphs:
                other.graphs[state.bucket].check_real = False
        entry.verify.real_batch = result = verify_real_batch(
            entry.step, lane.outputs.views(state.bucket), self.tolerance)
        if not result.passed:
            entry.verify.passed = False
            self.fall_back(lanes, state, CaptureError(
                "verification failed: " + "; ".join(result.failures), bucket=state.bucket.name,
                remedies=["loosen capture.verify.rtol / atol if the differences are rounding",
                          "set capture.on_failure: eager"]))
        return result.passed

    def fall_back(self, lanes: list[Lane], state: BucketState, err: CaptureError) -> None:
        """capture.on_failure: stop with `err`, or run the bucket eagerly on every lane."""
        if self.cap.on_failure == "error":
            raise err
        self.pool.fall_back(state, [lane.graphs[state.bucket] for lane in lanes
                                    if state.bucket in lane.graphs], str(err))
        self.log(f"warning: bucket {state.bucket.name} runs eagerly: {err}")


def model_failed(exc: BaseException, bucket: str, where: str, ids: list,
                 index_hint: str | None = None) -> ModelError:
    """The model raised on a batch of the stream: name the batch (its first record's place in
    the input, its ids), the bucket, and the model's own error line, without a traceback.
    index_hint: what an IndexError most likely comes from (models.call.index_hint)."""
    cause, at = _model_cause(exc)
    first = first_message(cause)
    shown = ", ".join(map(str, ids[:3])) + (f", ... {ids[-1]}" if len(ids) > 3 else "")
    text = (f"the model raised on the batch of {len(ids)} records from {where} (ids {shown}) "
            f"in bucket {bucket}: {type(cause).__name__}: {first}")
    if at:
        text += f"\n  at {at}"
    if index_hint and isinstance(cause, IndexError):
        return ModelError(text + f"\n  {index_hint}. The batches before it are committed; a "
                          "changed spec cannot --resume this folder: rerun with --overwrite "
                          "or another output.dir (--debug shows the traceback)")
    return ModelError(text + "\n  the batches before it are committed: fix the model, then "
                      "run again with --resume --accept-model-change to continue from this "
                      "batch (--debug shows the traceback)")


def setup_failed(exc: BaseException, bucket: str, hint: str | None = None) -> ModelError:
    """The model raised while a bucket was set up (its warm-up or verification, on seeded
    inputs of the bucket's shape), after its first call worked on another bucket: name the
    bucket, the model's own line and what to try."""
    cause, at = _model_cause(exc)
    first = first_message(cause)
    text = (f"the model raised while bucket {bucket} was set up (run on sample inputs of "
            f"that shape): {type(cause).__name__}: {first}")
    if at:
        text += f"\n  at {at}"
    hint = hint if isinstance(cause, IndexError) and hint else (
        "the model ran on a smaller bucket, so this shape is what it fails on: make it take "
        "this bucket's sizes, or leave them out of buckets (the largest value of an axis is "
        "the longest record it can take)")
    return ModelError(text + f"\n  {hint}; --debug shows the traceback")


def _model_cause(exc: BaseException) -> tuple[BaseException, str | None]:
    """The error of a chain raised in the model's own code, and its line (or exc, None)."""
    chain = error_chain(exc)
    at = next((w for w in map(model_frame, chain) if w), None)
    return next((e for e in chain if model_frame(e)), chain[0]), at
