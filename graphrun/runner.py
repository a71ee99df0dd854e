"""Runner: the model, its static buffers and one captured graph per bucket, ready to replay.

    with graphrun.Runner(spec) as runner:
        out = runner.run_batch({"tokens": t, "positions": p})   # real rows in, real rows out

Setup follows the flow: model -> static buffers -> capture (per bucket, largest first) ->
verify. A batch then goes: pad into a slot's pinned host staging views -> copy into the
static device views -> replay (or the eager step) -> copy the static outputs to the slot's
pinned host views -> cut the real rows out. The CPU path is the same with the `eager` backend,
without the streams.

On the GPU the copies run on two copy streams, the replays on the compute stream. For the
overlapped stream (host_slots(2) or more) every captured bucket is captured a second time, on
a second set of static buffers ("lane 1"; add_lane), and batches take the two lanes in turn:
while one lane's graph replays, the other lane's inputs are copied in and its last outputs
copied out, so the compute stream runs nothing but replays. With one lane the copies into and
out of the static buffers have to sit between the replays on the compute stream: on the H200
that took 413 us a batch of the MLP's 397 us graph (0.96x), two lanes 398.5 us (RESULTS.md).
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import numpy as np
import torch

from .buckets import Bucket, BucketTable, cut_rows, pad_into, rows_from_inputs, split_sizes
from .buffers import TORCH_DTYPES, BufferSet, HostSlot, host_dtype
from .capture import (MiB, BucketState, capture_graph, make_step, peak_step_bytes, warm_up)
from .errors import CaptureError, GraphrunError, InputError
from .device import resolve_backend, resolve_device
from .padding import add_padded_positions
from .models.load import (build_model, call_model, compile_model, first_call,
                          model_input_dtypes, name_outputs, unlisted_outputs)
from .spec import BATCH, PipelineSpec
from .timing import BatchTimer, sampled
from .verify import fill_synthetic, verify_bucket, verify_real_batch, verify_remedies


class Runner:
    def __init__(self, spec: PipelineSpec, *, log=None):
        self.spec = spec
        self.log = log or (lambda msg: None)
        self.device = resolve_device(spec.device)
        self.backend = resolve_backend(spec.capture.backend, self.device)
        self.cuda = self.device.type == "cuda"
        self.table = BucketTable(spec)
        self.input_specs = spec.inputs
        self.output_dims = {n: o.shape for n, o in spec.outputs.items()}
        self.states: dict[Bucket, BucketState] = {b: BucketState(b) for b in self.table.all}
        self.graph_pool = None
        self.timer = BatchTimer(self.device)
        # copies run on their own streams, beside the replays on the compute stream
        self._copy_streams = ((torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
                              if self.cuda else None)
        self._capture_stream = torch.cuda.Stream(self.device) if self.cuda else None
        # per lane: (static inputs, static outputs); lane 1 is made by add_lane()
        self.lanes: list[tuple[BufferSet, BufferSet]] = []
        # per lane, the event after which its static buffers are free again (its last batch's
        # outputs copied out); and the lane the next two-lane bucket's batch takes
        self._lane_free: list = [None, None]
        self._next_lane = 0
        self._graph_bytes = 0  # pool growth of the captures so far (capture.memory_budget_mib)
        self.setup_s = 0.0
        t0 = time.perf_counter()
        with self._device_ctx():
            with torch.inference_mode():
                self.model = build_model(spec, self.device, spec.base_dir)
            if spec.model.compile:
                self.model = compile_model(self.model, len(self.table.all))
            # Buffers are made outside inference mode: they are written in place per batch.
            self._allocate()
            self._prepare_buckets()
        self.setup_s = time.perf_counter() - t0

    # -- setup: buffers, capture, verify ------------------------------------------------------

    def _device_ctx(self):
        return torch.cuda.device(self.device) if self.cuda else nullcontext()

    def _switch_device(self):
        """A device context only where another device is current (a multi-GPU process)."""
        if self.cuda and torch.cuda.current_device() != self.device.index:
            return torch.cuda.device(self.device)
        return nullcontext()

    def _allocate(self) -> None:
        """Static input buffers at the largest bucket; outputs after one probe run gives dtypes."""
        largest = self.table.all[0]
        in_dims = {n: i.shape for n, i in self.input_specs.items()}
        self.model_dtypes = model_input_dtypes(self.spec)  # floating inputs in model.dtype
        # Static inputs in the host's dtype (bfloat16 staged as float32): the cast to the
        # model's dtype happens inside the captured step, not as a kernel per copy.
        in_dtypes = {n: host_dtype(TORCH_DTYPES[i.dtype]) for n, i in self.input_specs.items()}
        self.inputs = BufferSet(in_dims, in_dtypes, largest, self.device)
        views = self.inputs.views(largest)
        fill_synthetic(views, self.input_specs, torch.Generator().manual_seed(0))
        probe = self._probe(largest, {n: v.to(self.model_dtypes[n]) for n, v in views.items()})
        out_dtypes = {n: t.dtype for n, t in probe.items()}
        for n, spec in self.spec.outputs.items():
            if spec.dtype:
                out_dtypes[n] = TORCH_DTYPES[spec.dtype]
        # Static outputs in the host's dtype too: a bfloat16 output is rounded to bfloat16 and
        # cast to float32 inside the captured step, so its copy to the host is a plain copy,
        # not a conversion kernel launched per batch.
        self._rounding = {n: d for n, d in out_dtypes.items() if host_dtype(d) != d}
        host_out = {n: host_dtype(d) for n, d in out_dtypes.items()}
        self.outputs = BufferSet(self.output_dims, host_out, largest, self.device)
        self.lanes = [(self.inputs, self.outputs)]
        self._slot_dims = (in_dims, in_dtypes, host_out)
        self.slots: list[HostSlot] = []
        self.host_slots(1)

    def host_slots(self, count: int) -> int:
        """At least `count` slots (host staging buffers, pinned on a GPU); returns how many.
        The overlapped stream (replay.py) keeps several batches in flight, one slot each, and
        with two or more the captured buckets get their second lane (add_lane). Outputs are in
        the host's dtype, as the static outputs are (a bfloat16 output is float32 there, cast
        inside the step)."""
        in_dims, in_dtypes, out_dtypes = self._slot_dims
        largest, cpu = self.table.all[0], torch.device("cpu")
        while len(self.slots) < count:
            host_in = BufferSet(in_dims, in_dtypes, largest, cpu, pin=self.cuda)
            host_out = BufferSet(self.output_dims, out_dtypes, largest, cpu, pin=self.cuda)
            self.slots.append(HostSlot(host_in, host_out))
        if count >= 2:
            self.add_lane()
        return len(self.slots)

    def add_lane(self) -> None:
        """Lane 1: static buffers of lane 0's layout, and every captured bucket captured again
        on them ("twin" graphs), each replayed in turn with the first one (launch). The twin
        goes into its first graph's memory pool, on the same capture stream, so it reuses that
        graph's blocks: the two never run at once (both replay on the compute stream, one after
        the other). It is verified as the first graph was; a twin that cannot be captured, that
        fails verification or that would pass capture.memory_budget_mib is dropped with a
        warning, and its bucket runs on lane 0 alone, as before. The time counts as setup (and
        as the bucket's capture_s), the pool growth as its memory_bytes."""
        if len(self.lanes) > 1 or not self.cuda or self.backend != "cuda-graph":
            return
        t0 = time.perf_counter()
        in_dims, in_dtypes, out_dtypes = self._slot_dims
        largest = self.table.all[0]
        static_in = BufferSet(in_dims, in_dtypes, largest, self.device)
        # never garbage: an index the model looks up must be in its range, even in a warm-up
        fill_synthetic(static_in.views(largest), self.input_specs,
                       torch.Generator().manual_seed(1))
        self.lanes.append((static_in,
                           BufferSet(self.output_dims, out_dtypes, largest, self.device)))
        cap = self.spec.capture
        budget = cap.memory_budget_mib * MiB if cap.memory_budget_mib else None
        with self._device_ctx(), torch.inference_mode():
            for bucket, state in self.states.items():
                if state.graph is not None:
                    self._capture_twin(state, budget)
        self.setup_s += time.perf_counter() - t0

    def _capture_twin(self, state: BucketState, budget: float | None) -> None:
        bucket = state.bucket
        step = self.step(bucket, lane=1)
        try:
            warm_up(step, 1, self._capture_stream)  # lazy state of new tensors, outside capture
            twin, seconds, grown = capture_graph(step, bucket, stream=self._capture_stream,
                                                 pool=state.graph.pool())
        except GraphrunError as err:
            self.log(f"warning: bucket {bucket.name} runs on one lane: its second capture "
                     f"failed: {err}")
            return
        state.capture_s = (state.capture_s or 0.0) + seconds
        state.memory_bytes = (state.memory_bytes or 0) + grown
        self._graph_bytes += grown
        if budget is not None and self._graph_bytes > budget:
            self.log(f"warning: bucket {bucket.name} runs on one lane: its second graph would "
                     f"take the graphs to {self._graph_bytes / MiB:.1f} MiB, past "
                     f"memory_budget_mib={budget / MiB:g}")
            return
        if self.spec.capture.verify.enabled and state.verify is not None:
            static_in, static_out = self.lanes[1]
            check = verify_bucket(bucket, twin.replay, step, static_in.views(bucket),
                                  static_out.views(bucket), self.input_specs,
                                  self.spec.capture.verify.rtol, self.spec.capture.verify.atol)
            state.verify["twin_passed"] = check["passed"]
            if not check["passed"]:
                self.log(f"warning: bucket {bucket.name} runs on one lane: its second graph "
                         f"failed verification: {'; '.join(check['failures'])}")
                return
        state.twin, state.twin_check_real = twin, self.spec.capture.verify.enabled

    @property
    def slot_bytes(self) -> int:
        """Host bytes of one slot; slot 0 is made with the buffers."""
        return self.slots[0].inputs.nbytes + self.slots[0].outputs.nbytes

    def _probe(self, bucket: Bucket, inputs: dict[str, torch.Tensor]) -> dict:
        """The model's first call, on sample inputs of the largest bucket. Failing here is
        nearly always the spec and the model disagreeing: say so, with what was passed."""
        names = list(self.output_dims)
        ret = first_call(self.model, inputs, self.spec.model.call, f"bucket {bucket.name}")
        extra = unlisted_outputs(ret, names)
        if extra:
            self.log(f"warning: the model also returns {', '.join(extra)}, which outputs does "
                     "not list: not written; list it under outputs to keep it")
        return name_outputs(ret, names)

    def _prepare_buckets(self) -> None:
        cap = self.spec.capture
        stream = self._capture_stream
        if self.backend == "cuda-graph" and cap.pool == "shared":
            self.graph_pool = torch.cuda.graph_pool_handle()
        budget = cap.memory_budget_mib * MiB if cap.memory_budget_mib else None
        spent = 0
        for bucket in self.table.all:  # largest first
            state = self.states[bucket]
            step = state.run = self.step(bucket)
            # eager needs no warm-up but one run, which surfaces shape errors before any data
            graphs_or_compile = self.backend == "cuda-graph" or self.spec.model.compile
            iters = cap.warmup_iters if graphs_or_compile else 1
            state.warmup_s = warm_up(step, max(iters, 1), stream)
            if self.backend != "cuda-graph":
                state.status = "eager"
                state.reason = "backend eager" if self.cuda else "no CUDA device: backend eager"
                self._verify(state, step)
                continue
            if budget is not None and not self._fits(state, step, budget, spent):
                continue
            try:
                state.graph, state.capture_s, state.memory_bytes = capture_graph(
                    step, bucket, stream=stream,
                    pool=self.graph_pool if cap.pool == "shared" else None)
                state.status = "captured"
                state.run = state.graph.replay
            except CaptureError as err:
                self._fall_back(state, err)
                if self.graph_pool is not None:
                    # torch leaves a failed capture's pool marked as being recorded to (its
                    # capture_end raised before releasing it): later graphs share a new pool.
                    self.graph_pool = torch.cuda.graph_pool_handle()
                continue
            spent += state.memory_bytes
            self._graph_bytes = spent
            self._verify(state, step)
            self.log(f"captured {bucket.name} in {state.capture_s * 1e3:.1f} ms")

    def _fits(self, state: BucketState, step, budget: float, spent: int) -> bool:
        """memory_budget_mib: a bucket whose pool would pass the budget is dropped, not run."""
        need = peak_step_bytes(step, self.device)
        # in a shared pool, smaller buckets reuse the largest captured one's blocks
        total = max(spent, need) if self.spec.capture.pool == "shared" else spent + need
        if total <= budget:
            return True
        state.status = "skipped"
        state.reason = (f"needs about {need / MiB:.1f} MiB; with {spent / MiB:.1f} MiB already "
                        f"taken that passes memory_budget_mib={budget / MiB:g}")
        self.table.drop(state.bucket)
        self.log(f"warning: bucket {state.bucket.name} dropped: {state.reason}")
        return False

    def _fall_back(self, state: BucketState, err: CaptureError) -> None:
        if self.spec.capture.on_failure == "error":
            raise err
        state.graph = state.twin = None
        state.check_real = state.twin_check_real = False
        state.run = self.step(state.bucket)
        state.status = "eager"
        state.reason = str(err)
        self.log(f"warning: bucket {state.bucket.name} runs eagerly: {err}")

    def _verify(self, state: BucketState, step) -> None:
        cap = self.spec.capture
        if not cap.verify.enabled:
            return
        bucket = state.bucket
        state.verify = verify_bucket(bucket, state.run, step, self.inputs.views(bucket),
                                     self.outputs.views(bucket), self.input_specs,
                                     cap.verify.rtol, cap.verify.atol)
        if not state.verify["passed"]:
            note, remedies = verify_remedies(state.verify, captured=state.graph is not None,
                                             on_failure=cap.on_failure)
            err = CaptureError("verification failed: " + "; ".join(state.verify["failures"])
                               + note, bucket=bucket.name, remedies=remedies)
            if (state.graph is None or cap.on_failure == "error"
                    or state.verify["pad_isolated"] is False):  # eager would pad alike
                raise err
            self._fall_back(state, err)
        state.check_real = state.graph is not None  # an eager bucket needs no check against itself

    def _verify_real(self, state: BucketState, lane: int = 0) -> bool:
        """The first real batch of a captured bucket on a lane: replay vs eager on its inputs
        (the lane's static outputs then hold eager's results). False when they disagree and
        the bucket fell back to eager (on_failure: eager); with on_failure: error that stops
        the run."""
        if lane == 0:
            state.check_real = False
        else:
            state.twin_check_real = False
        cap = self.spec.capture
        result = verify_real_batch(self.step(state.bucket, lane),
                                   self.lanes[lane][1].views(state.bucket),
                                   cap.verify.rtol, cap.verify.atol)
        state.verify["real_batch" if lane == 0 else "twin_real_batch"] = result
        if not result["passed"]:
            state.verify["passed"] = False
            err = CaptureError("verification failed: " + "; ".join(result["failures"]),
                               bucket=state.bucket.name,
                               remedies=["loosen capture.verify.rtol / atol if the differences "
                                         "are rounding", "set capture.on_failure: eager"])
            if cap.on_failure == "error":
                raise err
            self._fall_back(state, err)
        return result["passed"]

    def step(self, bucket: Bucket, lane: int = 0):
        """The eager step of a bucket, on a lane's static buffers."""
        static_in, static_out = self.lanes[lane]
        return make_step(self.model, self.spec.model.call, static_in.views(bucket),
                         static_out.views(bucket), self.model_dtypes, self._rounding)

    def measure_baseline(self, iters: int = 20) -> None:
        """report.baseline: eager, median eager step and median replay of each bucket, timed
        side by side on the same inputs (CUDA events on the GPU, host clocks on the CPU)."""
        with self._device_ctx(), torch.inference_mode():
            for bucket, state in self.states.items():
                if state.run is None:
                    continue
                fill_synthetic(self.inputs.views(bucket), self.input_specs,
                               torch.Generator().manual_seed(bucket.volume))
                state.eager_us = self._median_us(self.step(bucket), iters)
                state.replay_us = self._median_us(state.run, iters)

    def _median_us(self, fn, iters: int) -> float:
        fn()  # one untimed call: caches warm
        times = []
        for _ in range(iters):
            t = self.timer.start(-1)  # not a launch's events
            stream = torch.cuda.current_stream() if self.cuda else None
            t0 = self.timer.record(t, "run<", stream)
            fn()
            t.spans["run"] = (t0, self.timer.record(t, "run", stream))
            times.append(self.timer.finish(t)["run"])
        return float(np.median(times))

    # -- running batches ---------------------------------------------------------------------

    def stage(self, fields: dict, n: int, lengths: dict[str, np.ndarray], slot: int) -> Bucket:
        """Pick the bucket for n real rows and pad them into host slot `slot`'s staging views."""
        want = {a: int(v.max()) if len(v) else 1 for a, v in lengths.items()}
        bucket = self.table.pick(n, want)
        if bucket is None:
            raise InputError(f"no bucket covers {n} records with lengths {want}")
        staging = self.slots[slot].inputs
        for name, rows in fields.items():
            pad_into(staging.numpy_view(name, bucket), rows, self.input_specs[name].pad)
        return bucket

    def current_stream(self):
        """The stream launches go to from this thread (None on the CPU)."""
        if not self.cuda:
            return None
        with self._switch_device():
            return torch.cuda.current_stream()

    def device_context(self):
        """The runner's device made current for a stream of launches (a no-op on the CPU)."""
        return self._switch_device()

    def launch(self, bucket: Bucket, slot: int, *, timed: bool | None = None,
               stream=None) -> object:
        """Enqueue a staged batch; nothing waits here. Returns its marks, for collect().

        On the GPU the batch takes a lane: the next one in turn where its bucket has a twin
        (add_lane), else lane 0. The copy-in stream waits until the lane's last batch is out of
        its static buffers, then copies the slot's pinned inputs into the lane's static input
        views; the compute stream (`stream`, this thread's current one) waits for that and
        replays; the copy-out stream waits for the replay and copies the lane's static outputs
        to the slot's pinned outputs. The slot must be free: its last batch collected.
        The hot path: copies prebuilt, events reused, no context managers; every CUDA call
        here lets another thread take the GIL, so there are as few as the lanes need.
        stream given: the caller made the runner's device current (device_context()).
        timed: per-phase events; None: a sample of the bucket's batches (timing.sampled);
        False (run_batch, which returns no timings): only the events waited on."""
        state, timer = self.states[bucket], self.timer
        lane = self._next_lane if state.twin is not None else 0
        self._next_lane = lane ^ 1
        static_in, static_out = self.lanes[lane]
        copies = self.slots[slot].copies(bucket, lane, static_in, static_out)
        if timed is None:
            timed = sampled(state.launches)
            state.launches += 1
        # events are reused per (slot, lane): a lane's free event is re-recorded only by its
        # next batch, after that batch waited on it
        marks = timer.start((slot, lane), timed=timed)
        if not self.cuda:
            t0 = timer.record(marks, "start")
            for dst, src in copies.h2d:
                dst.copy_(src)
            t1 = timer.record(marks, "h2d")
            state.run()
            t2 = after = timer.record(marks, "replay")
            if state.check_real:  # the check's time is not the replay's
                self._verify_real(state)
                after = timer.record(marks, "checked")
            for dst, src in copies.d2h:
                dst.copy_(src)
            if timed:
                marks.spans = {"h2d": (t0, t1), "replay": (t1, t2),
                               "d2h": (after, timer.record(marks, "d2h"))}
            return marks
        if stream is None:
            with self._switch_device():
                self._next_lane = lane  # taken again by the call below
                return self.launch(bucket, slot, timed=timed,
                                   stream=torch.cuda.current_stream())
        record, set_stream = timer.record, torch.cuda.set_stream
        copy_in, copy_out = self._copy_streams
        free = self._lane_free[lane]
        try:
            set_stream(copy_in)
            if free is not None:
                copy_in.wait_event(free)
            h0 = record(marks, "h2d<", copy_in) if timed else None
            for dst, src in copies.h2d:
                dst.copy_(src, non_blocking=True)
            h1 = record(marks, "h2d", copy_in)
            set_stream(stream)
            stream.wait_event(h1)
            r0 = record(marks, "replay<", stream) if timed else None
            (state.run if lane == 0 else state.twin.replay)()
            r1 = after = record(marks, "replay", stream)
            if state.check_real if lane == 0 else state.twin_check_real:
                # the lane's first real batch, checked against eager: the static outputs then
                # hold eager's, and are copied out after the check (its time is not the replay's)
                self._verify_real(state, lane)
                after = record(marks, "checked", stream)
            set_stream(copy_out)
            copy_out.wait_event(after)
            for dst, src in copies.d2h:
                dst.copy_(src, non_blocking=True)
            d1 = self._lane_free[lane] = record(marks, "d2h", copy_out)
        finally:
            set_stream(stream)
        if timed:
            marks.spans = {"h2d": (h0, h1), "replay": (r0, r1), "d2h": (after, d1)}
        return marks

    def collect(self, bucket: Bucket, slot: int, marks, n: int,
                lengths: dict[str, np.ndarray]):
        """Wait for a launched batch; return its real rows (fresh arrays) and phase times."""
        times = self.timer.finish(marks)
        host = self.slots[slot].outputs
        outs = {name: cut_rows(host.numpy_view(name, bucket)[:n].copy(), dims, lengths)
                for name, dims in self.output_dims.items()}
        stats = self.states[bucket].stats
        stats["batches"] += 1
        stats["records"] += n
        stats["padded_rows"] += bucket.batch - n
        add_padded_positions(stats, bucket, lengths, n)  # issue 18: padding per bucket axis
        return outs, times

    def run_padded(self, fields: dict, n: int, lengths: dict[str, np.ndarray], *,
                   timed: bool = True):
        """Real rows (n of them) through the right bucket, waiting for the result:
        (outputs, bucket, timings)."""
        bucket = self.stage(fields, n, lengths, 0)
        marks = self.launch(bucket, 0, timed=timed)
        outs, times = self.collect(bucket, 0, marks, n, lengths)
        return outs, bucket, times

    def run_batch(self, inputs: dict) -> dict[str, np.ndarray | list[np.ndarray]]:
        """The Python API: arrays or tensors of real rows (a dense array [n, ...] or a list of
        per-record arrays per input) -> real output rows, cut to each record's length."""
        fields, n, lengths = rows_from_inputs(inputs, self.input_specs, self.table.axes)
        if n <= self.table.max_batch:
            return self.run_padded(fields, n, lengths, timed=False)[0]
        return self.run_rows(fields, n, lengths)[0]

    def run_rows(self, fields: dict, n: int, lengths: dict[str, np.ndarray]):
        """n real rows, any n: through one bucket, or per data.oversize when n is larger than
        every batch bucket. Returns (outputs, [(bucket or None, phase times)])."""
        largest = self.table.max_batch
        if n <= largest:
            outs, bucket, times = self.run_padded(fields, n, lengths)
            return outs, [(bucket, times)]
        oversize = self.spec.data.oversize
        if oversize == "error":
            raise InputError(f"a batch of {n} records is larger than the largest batch bucket "
                             f"({largest}): add a bucket or set data.oversize: split")
        if oversize == "eager":
            t0 = time.perf_counter()
            outs = self.run_unbucketed(fields, n, lengths)
            return outs, [(None, {"e2e": (time.perf_counter() - t0) * 1e6})]
        parts, ran, start = [], [], 0
        for size in split_sizes(n, largest):
            sl = slice(start, start + size)
            outs, bucket, times = self.run_padded({k: v[sl] for k, v in fields.items()}, size,
                                                  {a: v[sl] for a, v in lengths.items()})
            parts.append(outs)
            ran.append((bucket, times))
            start += size
        return {name: _concat([p[name] for p in parts]) for name in self.output_dims}, ran

    def run_unbucketed(self, fields: dict, n: int, lengths: dict[str, np.ndarray]):
        """oversize: eager - the model called directly at the batch's own padded size."""
        sizes = {BATCH: n, **{a: int(v.max()) for a, v in lengths.items()}}
        with self._device_ctx(), torch.inference_mode():
            tensors = {}
            for name, spec in self.input_specs.items():
                shape = tuple(sizes[d] if isinstance(d, str) else d for d in spec.shape)
                host = np.empty(shape, dtype=self.slots[0].inputs.flat[name].numpy().dtype)
                pad_into(host, fields[name], spec.pad)
                tensors[name] = torch.from_numpy(host).to(self.device, self.model_dtypes[name])
            got = name_outputs(call_model(self.model, tensors, self.spec.model.call),
                               list(self.output_dims))
            return {name: cut_rows(_fresh_rows(got[name].cpu(), n), self.output_dims[name],
                                   lengths) for name in self.output_dims}

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        if self.cuda:  # nothing of any stream may still use a buffer freed below
            torch.cuda.synchronize(self.device)
        for state in self.states.values():
            state.graph = state.run = state.twin = None
        self.slots = []
        self.graph_pool = None
        if self.cuda:
            torch.cuda.empty_cache()

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fresh_rows(host: torch.Tensor, n: int) -> np.ndarray:
    """The first n rows of a host tensor as a new numpy array (bfloat16 -> float32)."""
    rows = host[:n]
    return rows.float().numpy() if rows.dtype == torch.bfloat16 else rows.numpy().copy()


def _concat(parts: list) -> np.ndarray | list:
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    return [row for p in parts for row in p]
