"""Runner: the model, its lanes (static buffers and one captured graph per bucket), ready to run.

    with graphrun.Runner(spec) as runner:
        out = runner.run_batch({"tokens": t, "positions": p})   # real rows in, real rows out

Setup follows the flow: model -> static buffers (lanes.py) -> capture and verify per bucket,
largest first (capture.py). A batch then runs one of two ways: run_batch, one synchronous call
on the caller's stream (direct.py), or, for the file's stream (feed/), stage ->
launch -> Launch.result() on host slots and copy streams: `runner.launcher` (launch.py), the
feed's engine, given the table, lanes, states and setup callables it needs at construction.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from functools import partial
from typing import Callable

import numpy as np
import torch

from graphrun.engine.buckets import Bucket, BucketTable, cut_rows, pad_into, split_rows
from graphrun.engine.device import made_current, resolve_backend, resolve_device
from graphrun.engine.device_start import DeviceStart
from graphrun.base.errors import (GraphrunError, ModelError, Problem, SpecError,
                                  first_message)
from graphrun.manifest.keys import BucketReport, LaneReport
from graphrun.base.phases import FIRST_USE, phase
from graphrun.models.call import (call_model, first_call, index_hint, name_outputs,
                                 unlisted_outputs)
from graphrun.models.hf import model_code
from graphrun.models.load import build_model, compile_model, import_library, model_input_dtypes
from graphrun.spec.keys import BATCH, PipelineSpec
from graphrun.base.dtypes import torch_dtype
from graphrun.engine.buffers import host_dtype
from graphrun.engine.capture import BucketState, Capturer
from graphrun.engine.lazy import first_use_failed
from graphrun.engine.direct import Direct
from graphrun.engine.inputs import check_batch
from graphrun.engine.lanes import Lane, Layout, output_shape_problem
from graphrun.engine.launch import Launcher, fresh_rows
from graphrun.engine.timing import median_us, sampled
from graphrun.engine.verify import fill_synthetic


class Runner:
    def __init__(self, spec: PipelineSpec, *, log=None, needs=None,
                 started: DeviceStart | None = None, sampled: Callable[[int], bool] = sampled):
        """needs: with capture.lazy, table -> the buckets to set up now (lazy.py; asked after
        the model is built), each with the input's first batch for it (or None), checked
        against eager at setup; the others are set up on first use. None: all on first use.
        started: the device's context begun earlier, beside other setup (device_start.py).
        sampled: which of a bucket's batches are timed per phase (timing.sampled)."""
        if not isinstance(spec, PipelineSpec):
            raise GraphrunError(f"graphrun.Runner takes a PipelineSpec, got {type(spec).__name__}"
                                ": graphrun.load_spec(path) reads a spec file into one")
        if spec.generate is not None:  # the model's forward is not what a generation job calls
            raise SpecError([Problem(
                str(spec.source_path or "spec"), "generate",
                "Runner replays one forward pass per batch, and this is a generation spec "
                "(generate:, data.chat or an OpenAI Batch file): run the job with "
                "graphrun.run(spec) (or `graphrun run`), whose completions go to output.dir, "
                "or in-process with graphrun.LLM(spec).generate(prompts) (or "
                "graphrun.generate(spec, prompts)), which returns them in order")])
        self.spec = spec
        self.log = log or (lambda msg: None)
        # run_batch from several threads: one at a time, as they share the static buffers
        self._calls = threading.RLock()
        t0 = time.perf_counter()
        started = started or DeviceStart.begin(spec)
        self.model_code = model_code(spec)  # the folder's headers read: no library imported
        import_library(spec, self.model_code[0])  # CPU work, beside the device's start
        with phase("cuda context") if started else nullcontext():  # the wait for it
            self.device = started.wait() if started else resolve_device(spec.device)
        self.backend = resolve_backend(spec.capture.backend, self.device)
        self.cuda = self.device.type == "cuda"
        self.table = BucketTable(spec)
        self.states: dict[Bucket, BucketState] = {b: BucketState(b) for b in self.table.all}
        with made_current(self.device):
            with torch.inference_mode(), phase("model build"):
                self.model = build_model(spec, self.device, spec.base_dir)
            if spec.model.compile:
                with phase("compile"):
                    self.model = compile_model(self.model, len(self.table.all))
            with phase("read ahead"):  # capture.lazy: the first batches, to decide from
                needed = (needs(self.table) if needs else {}) if spec.capture.lazy else None
            # Buffers are made outside inference mode: they are written in place per batch.
            with phase("first call and buffers"):
                self.layout = self._layout(min(needed, key=lambda b: (b.volume, b.sizes))
                                           if needed else self.table.all[-1])
                self.lanes: list[Lane] = [self._new_lane(0)]
                self.capturer = Capturer(self.model, spec, self.device, self.backend,
                                         self.layout, self.log)
            with phase("bucket setup"):  # warm-up, capture and verify are phases in it
                self.capturer.first_lane(self.lanes[0], self.states, self.table, needed)
                if needed is not None and needs:  # what the reader held meanwhile, too
                    late = {b: x for b, x in needs(self.table).items() if b not in needed}
                    for bucket in self.capturer.read_meanwhile(self.lanes[0], self.states,
                                                                self.table, late):
                        needed[bucket] = late[bucket]
                self.launcher = Launcher(
                    self.table, self.layout, self.lanes, self.states, inputs=spec.inputs,
                    device=self.device, set_up=self.first_use,
                    check_real=partial(self.capturer.check_real, self.lanes),
                    second_lane=self._second_lane, eager=self.run_unbucketed,
                    oversize=spec.data.oversize, explain=self._explain, sampled=sampled)
                self.direct = Direct(self.launcher)
            if needed and self.backend == "cuda-graph":
                with phase("verify on the input's batches"):
                    self.launcher.check_ahead(needed)
        self.setup_s = time.perf_counter() - t0

    # -- setup ---------------------------------------------------------------------------------

    def _layout(self, probed: Bucket) -> Layout:
        """The static buffers' names, shapes and dtypes; the outputs' dtypes from one probe run
        on seeded sample inputs of `probed`, the smallest bucket set up (the cheapest call)."""
        specs = self.spec.inputs
        in_dims = {n: i.shape for n, i in specs.items()}
        in_dtypes = model_input_dtypes(self.spec)  # floating inputs in model.dtype
        sample = {n: torch.empty(probed.shape(d), dtype=in_dtypes[n], device=self.device)
                  for n, d in in_dims.items()}
        fill_synthetic(sample, specs, torch.Generator().manual_seed(0))
        probe = self._probe(probed, sample)
        for name, t in probe.items():  # here, not in a warm-up: the eager backend has none
            want = probed.shape(self.spec.outputs[name].shape)
            if list(t.shape) != list(want):
                raise ModelError(output_shape_problem(name, list(t.shape), list(want)))
        out_dtypes = {n: torch_dtype(o.dtype) if o.dtype else probe[n].dtype
                      for n, o in self.spec.outputs.items()}
        return Layout(in_dims, in_dtypes, {n: o.shape for n, o in self.spec.outputs.items()},
                      out_dtypes)

    def _probe(self, bucket: Bucket, inputs: dict[str, torch.Tensor]) -> dict:
        """The model's first call. Failing here is nearly always the spec and the model
        disagreeing: first_call says so, with what was passed."""
        names = list(self.spec.outputs)
        ret = first_call(self.model, inputs, self.spec.model.call, f"bucket {bucket.name}",
                         self.spec.inputs)
        extra = unlisted_outputs(ret, names)
        if extra:
            self.log(f"warning: the model also returns {', '.join(extra)}, which outputs does "
                     "not list: not written; list it under outputs to keep it")
        return name_outputs(ret, names)

    def _new_lane(self, index: int) -> Lane:
        return Lane(index, self.layout, self.table.all[0], self.device, self.spec.inputs)

    def _second_lane(self) -> bool:
        """The overlapped stream's second lane, each captured bucket captured again on it (the
        launcher asks once it has two slots); False where graphs are not captured."""
        if self.backend != "cuda-graph":
            return False
        t0 = time.perf_counter()
        lane = self._new_lane(len(self.lanes))
        self.lanes.append(lane)
        with made_current(self.device), torch.inference_mode():
            self.capturer.another_lane(lane, self.states)
        self.setup_s += time.perf_counter() - t0
        return True

    def measure_baseline(self, iters: int = 20) -> None:
        """report.baseline: eager, median eager step and median replay of each bucket set up,
        timed side by side on the same inputs (CUDA events on the GPU, host clocks on the
        CPU); a bucket set up later (capture.lazy) is timed on its first use."""
        with made_current(self.device), torch.inference_mode():
            for state in self.states.values():
                self._baseline(state, iters)

    def _baseline(self, state: BucketState, iters: int = 20) -> None:
        lane, bucket = self.lanes[0], state.bucket
        entry = lane.graphs.get(bucket)
        if entry is None:
            return
        fill_synthetic(lane.inputs.views(bucket), self.spec.inputs,
                       torch.Generator().manual_seed(bucket.volume))
        state.eager_us = median_us(self.launcher.timer, entry.step, iters)
        state.replay_us = median_us(self.launcher.timer, entry.run, iters)

    # -- capture.lazy ----------------------------------------------------------------------

    def _explain(self, exc: BaseException) -> str | None:
        """An IndexError is most often an input's range or pad past an embedding table."""
        return index_hint(self.model, self.spec.inputs) if isinstance(exc, IndexError) else None

    @property
    def default_path(self) -> tuple[bool, str]:
        """(overlapped, why) where neither the caller nor GRAPHRUN_OVERLAP chose: serial on
        the CPU, where torch's own threads run the model on every core."""
        return (True, "the default on a GPU") if self.cuda else (False, "the default on the CPU")

    def first_use(self, state: BucketState, batch: int) -> None:
        """capture.lazy: batch number `batch` needs a bucket not set up yet. Wait for the lanes'
        work in flight (no capture beside it), set it up on every lane, then go on. Its time
        is one phase of the run (FIRST_USE), not the stream's; a failure names the batch."""
        with made_current(self.device):
            if self.cuda:  # the batches in flight finish: the stream's time
                torch.cuda.synchronize(self.device)
            with phase(FIRST_USE, whole=True):
                try:
                    self.capturer.first_use(self.lanes, state, self.table, batch)
                except GraphrunError as err:
                    state.reason = (f"its setup on first use (batch {batch}) failed: "
                                    f"{first_message(err)}")
                    raise first_use_failed(err, state.bucket.name, batch) from err
                if self.spec.report.baseline == "eager":
                    with torch.inference_mode():
                        self._baseline(state)
        self.launcher.lanes_changed()

    # -- running batches -----------------------------------------------------------------------

    def run_batch(self, inputs: dict, *, device: bool = False) -> dict:
        """The Python API: real rows in (per input a dense array or tensor [n, ...], or a list
        of per-record arrays), real rows out, cut to each record's length.

        Dense torch tensors in (host or device): torch tensors out in the model's dtype, on
        the host (pinned on a GPU), or with device=True on the runner's device (ordered on the
        current stream, not waited for). Otherwise numpy out (bfloat16 as float32). Inputs are
        checked as a file's records are (rank, fixed sizes, integer data, range, finite)."""
        with self._calls:
            if self.launcher is None:  # close() dropped the buffers and graphs
                raise GraphrunError("this graphrun.Runner is closed (close() was called, or "
                                    "its with block ended): build a new Runner to run batches")
            batch = check_batch(inputs, self.spec.inputs, self.table.axes)
            if batch.n > self.table.max_batch:
                return self._run_oversize(batch, device)
            with made_current(self.device):
                if batch.tensors:
                    return self.direct.tensors(batch, device=device)
                return self.direct.arrays(batch)

    def _run_oversize(self, batch, device: bool) -> dict:
        """More records than the largest batch bucket: data.oversize decides."""
        if not batch.tensors or self.spec.data.oversize != "split":
            outs = self.launcher.run_rows(batch.as_numpy().fields, batch.n, batch.lengths)[0]
            return outs if not batch.tensors else {
                k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                for k, v in outs.items()}
        parts = [self.run_batch({k: v[sl] for k, v in batch.fields.items()}, device=device)
                 for sl in split_rows(batch.n, self.table.max_batch)]
        return {name: torch.cat([p[name] for p in parts]) for name in self.spec.outputs}

    def run_unbucketed(self, fields: dict, n: int, lengths: dict[str, np.ndarray]):
        """data.oversize: eager - the model called directly at the batch's own padded size."""
        sizes = {BATCH: n, **{a: int(v.max()) for a, v in lengths.items()}}
        lay = self.layout
        with made_current(self.device), torch.inference_mode():
            tensors = {}
            for name, spec in self.spec.inputs.items():
                shape = tuple(sizes[d] if isinstance(d, str) else d for d in spec.shape)
                # the rows' own (the spec's) dtype, cast once on the way to the model
                host = torch.empty(shape, dtype=host_dtype(torch_dtype(spec.dtype))).numpy()
                pad_into(host, fields[name], spec.pad)
                tensors[name] = torch.from_numpy(host).to(self.device, lay.in_dtypes[name])
            got = name_outputs(call_model(self.model, tensors, self.spec.model.call),
                               list(lay.out_dims))
            return {name: cut_rows(fresh_rows(got[name].to(lay.out_dtypes[name]).cpu(), n),
                                   lay.out_dims[name], lengths) for name in lay.out_dims}

    # -- what it did, for the manifest ---------------------------------------------------------

    def bucket_reports(self) -> list[BucketReport]:
        """Per bucket: status, costs, counts and each lane's verification; latency_us is the
        caller's (it holds the batches' timings)."""
        reports = []
        for bucket, s in self.states.items():
            lanes = [LaneReport(verify=lane.graphs[bucket].verify)
                     for lane in self.lanes if bucket in lane.graphs]
            reports.append(BucketReport(
                name=bucket.name, sizes=dict(zip(bucket.axes, bucket.sizes)),
                status=s.status if s.status != "pending" else "skipped", reason=s.reason,
                set_up=s.set_up, first_use_batch=s.first_use_batch,
                warmup_s=s.warmup_s, capture_s=s.capture_s, memory_bytes=s.memory_bytes,
                lanes=lanes, eager_us=s.eager_us, replay_us=s.replay_us,
                speedup=s.eager_us / s.replay_us if s.eager_us and s.replay_us else None,
                **s.stats))
        return reports

    # -- lifetime ------------------------------------------------------------------------------

    def manifest_sections(self, percentiles, rejected: int = 0, truncated: int = 0) -> dict:
        """The manifest's sections of this engine's own (a generation job's engine has one):
        a forward pass has none beyond the buckets and totals every job has."""
        return {}

    def close(self) -> None:
        with self._calls:  # after a run_batch in flight
            if self.cuda:  # nothing of any stream may still use a buffer freed below
                torch.cuda.synchronize(self.device)
            for lane in self.lanes:
                lane.drop()
            self.direct = self.launcher = None  # their views and slots hold the buffers
            self.capturer.pool.close()
            if self.cuda:
                torch.cuda.empty_cache()

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

