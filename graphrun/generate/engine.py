"""The generation engine: a pool of decode slots, a scheduler that admits prompts as slots free
up, a packed prefill, then the decode steps that every occupied slot takes together.

It owns the static state of generation on one device: the paged KV cache (kv_cache.py), the
slot buffers (steps.py) and the graph table (graphs.py): one decode graph per row count (a few
sizes up to the slots, for the job's tail) and one prefill graph per packed token count.

The scheduler's loop (serve), on one thread:
1. take prompts from the source while slots are free (blocking only when nothing runs);
2. admit: the first waiting prompts into the lowest free slots, as many as the free slots, the
   blocks and the largest prefill allow; they are packed into one sequence and prefilled, which
   writes their keys into their blocks and picks each one's first token (prefill then join: the
   decode step stays one uniform graph, see docs/architecture.md);
3. decode: the smallest decode graph covering the highest occupied slot, after growing any row
   whose blocks would not cover the next steps (and, in the job's tail, when no prompt waits,
   after moving rows down to the lowest free slots, so the graph shrinks with them);
4. read back the output of the launch before the last: each launch copies its picked tokens to
   pinned host memory behind an event, and the host waits on the previous launch's event only
   after the next is queued, so the device always has a step queued. The host then appends each
   row's token, and a row that stopped (a stop id, or its max_new_tokens) leaves at once: its
   completion goes to the caller, its blocks back to the pool, its slot to the next prompt.

A record's tokens depend only on the model, its prompt and (seed, record id, position): its
slot, its neighbours and when it was admitted change nothing (sampling.py).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch

from graphrun.base.dtypes import torch_dtype
from graphrun.base.units import MiB
from graphrun.spec.request import EXTRA_STOPS, RequestParams

from graphrun.generate.compiled import CompiledStep
from graphrun.generate.config import (Completion, GenerateConfig, GenerationError, check_config)
from graphrun.generate.graphs import GraphTable, StepKey
from graphrun.generate.hf_attention import HFCausalLM, is_hf_model, unsupported
from graphrun.generate.kv_cache import BlockPool, PagedCache
from graphrun.generate.llama import Llama, OwnLM
from graphrun.generate.sampling import record_key
from graphrun.generate.stats import GenerationStats
from graphrun.generate.steps import HOST_FIELDS, SlotState, decode_step, prefill_step

LOOKAHEAD = 16  # decode steps a row's blocks cover ahead: block growth is not per token
AUTO_SLOTS = 256  # slots: auto at most (more rows per step than decode benefits from)
AUTO_MEMORY = 0.5  # slots: auto takes this share of the device memory left for the KV cache
RING = 4  # pinned output buffers: launches unread at most


@dataclass
class Request:
    """One prompt for the engine; `tag` is the caller's (where the completion goes)."""

    prompt: list[int]
    record_id: object
    params: RequestParams | None = None
    tag: object = None
    taken_s: float = 0.0  # when the engine took it (its TTFT counts from here)


@dataclass
class Finished:
    request: Request
    completion: Completion


@dataclass
class _Row:
    """A slot's record while it runs."""

    request: Request
    slot: int
    max_new: int
    stops: frozenset
    blocks: list[int]
    cap: int  # blocks it may come to hold
    taken_s: float
    joined: bool = False  # its prefill's output read: its decode tokens count from then
    steps: int = 0  # decode steps launched since its prefill
    tokens: list[int] = field(default_factory=list)
    first_s: float = 0.0


@dataclass
class _Launch:
    kind: str  # "prefill" | "decode"
    rows: list  # prefill: the rows in pack order; decode: the slots' rows at launch ([b])
    buffer: int  # the pinned output it copied into
    event: object  # torch.cuda.Event after the copy (None on the CPU)
    timing: tuple | None  # (start, end) timing events on a GPU
    host_s: float  # the CPU's step time


def adapt(model, max_len: int):
    """(step model, KV layout, close) for a model the engine can drive, else one error."""
    if isinstance(model, OwnLM):
        checkpoint = model.eos_ids is not None  # loaded from a folder, not the builtin
        if max_len > model.max_len:
            limit = ("max_position_embeddings" if checkpoint else "max_len")
            raise GenerationError(
                f"{model.shape.family}: the longest prompt + max_new_tokens is {max_len} "
                f"tokens, past the model's {limit} ({model.max_len}): lower the longest "
                "prompt (buckets.seq) or max_new_tokens" + (
                    "" if checkpoint else ", or give the model a larger max_len"))
        window = model.shape.window
        if window is not None and window < max_len:
            raise GenerationError(
                f"{model.shape.family}: sliding-window attention (sliding_window={window}) is "
                f"not supported; keep the longest prompt + max_new_tokens ({max_len}) within "
                "the window")
        return model, model.layout, lambda: None
    if is_hf_model(model):
        hf = HFCausalLM(model, max_len)
        return hf, hf.layout, hf.close
    raise unsupported(model)


def _place(model, device: torch.device, dtype: torch.dtype) -> None:
    """The model on the engine's device in its dtype, moved only when it is not there;
    graphrun's own models remake their float32 RoPE frequencies, which a dtype cast rounds,
    and its Llama stacks its projections (Llama.fuse_projections)."""
    params = [t for t in model.parameters() if t.is_floating_point()]
    if not all(t.device == device and t.dtype == dtype for t in params):
        model.to(device=device, dtype=dtype)
    if isinstance(model, OwnLM):  # also after a cast by the caller (models/load.py does one)
        model.make_scratch()
    if isinstance(model, Llama):
        model.fuse_projections()


def decode_sizes(slots: int, sizes: Iterable[int] | None = None) -> list[int]:
    """The decode graphs' row counts: those given (up to the slots), else powers of two and
    the halfway points between them (a step pads a third of its rows at most); the slots
    themselves always."""
    given = sorted({s for s in (sizes or []) if 1 <= s <= slots})
    if not given:
        n = 1
        while n < slots:
            given += [n, n + n // 2] if n > 1 else [n]
            n *= 2
    return sorted({s for s in given if s <= slots} | {slots})


def prefill_sizes(given: Iterable[int] | None, longest: int, budget: int) -> list[int]:
    """The packed prefill's token counts: those given (the spec's buckets.seq), else powers of
    two from 16; then doubling from the largest up to the budget (at least the longest
    prompt)."""
    top = max(budget, longest)
    sizes = sorted({s for s in (given or []) if 1 <= s <= top})
    n = sizes[-1] if sizes else 16
    while n < top:
        sizes.append(n)
        n *= 2
    return sorted(set(sizes) | {top})


def auto_slots(slot_bytes: int, device: torch.device, rows: Iterable[int] | None) -> int:
    """slots: auto. On a GPU: as many records at their longest (slot_bytes of KV cache each) as
    AUTO_MEMORY of the memory left holds, at most AUTO_SLOTS, a multiple of 8 from 8 on; on the
    CPU, where rows cost time rather than memory: the largest decode size given, else 16."""
    if device.type != "cuda":
        return max(rows) if rows else 16
    free, _ = torch.cuda.mem_get_info(device)
    n = min(AUTO_SLOTS, int(free * AUTO_MEMORY // slot_bytes))
    return max(1, n - n % 8 if n >= 8 else n)


class Engine:
    """Slots, blocks, graphs and the scheduler over them (module docstring)."""

    def __init__(self, model, *, config: GenerateConfig, slots: int | str, max_prompt: int,
                 device, dtype, backend: str, block_size: int = 16,
                 num_blocks: int | None = None, rows: Iterable[int] | None = None,
                 prompts: Iterable[int] | None = None, prefill_tokens: int | None = None,
                 pool=None, verify: bool = True,
                 memory_budget_mib=None, compile: bool = False, sample: bool | None = None,
                 filtered: bool | None = None, admit_min: int | None = None,
                 log: Callable[[str], None] | None = None):
        self.config, self.log = config, log or (lambda line: None)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = self.device.type == "cuda"
        self.dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
        if backend not in ("cuda-graph", "eager"):
            raise GenerationError(f"backend {backend!r}: give 'cuda-graph' or 'eager'")
        if backend == "cuda-graph" and not self.cuda:
            backend = "eager"
        if max_prompt < 1 or block_size < 1:
            raise GenerationError(f"generate: the longest prompt ({max_prompt}) and the KV "
                                  f"block size ({block_size}) must each be at least 1")
        self.max_len = max_prompt + config.max_new_tokens
        self.model, layout, self._close_model = adapt(model, self.max_len)
        check_config(config, self.model.vocab)
        _place(model, self.device, self.dtype)
        self.max_blocks = -(-self.max_len // block_size)  # a row's blocks at most
        if slots == "auto":
            slots = auto_slots(self.max_blocks * PagedCache.bytes_per_block(
                layout, block_size, self.dtype), self.device, rows)
        if slots < 1:
            raise GenerationError(f"generate: slots is {slots}: give at least 1")
        self.slots, self.max_prompt, self.block_size = slots, max_prompt, block_size
        self.num_blocks = num_blocks or slots * self.max_blocks + 1
        if self.num_blocks < self.max_blocks + 1:
            raise GenerationError(
                f"generate: {self.num_blocks} KV blocks cannot hold one record of "
                f"{self.max_len} tokens ({self.max_blocks} blocks of {block_size}, and the "
                "trash block): give more blocks or a smaller max_new_tokens")
        self.kv_bytes = self.num_blocks * PagedCache.bytes_per_block(layout, block_size,
                                                                   self.dtype)
        budget = memory_budget_mib * MiB if memory_budget_mib else None
        if budget is not None and self.kv_bytes > budget:
            raise GenerationError(
                f"the KV cache of {self.num_blocks} blocks of {block_size} tokens takes "
                f"{self.kv_bytes / MiB:.1f} MiB, past memory_budget_mib={memory_budget_mib}: "
                "lower the slots, the longest prompt or max_new_tokens, or raise the budget")
        self.cache = PagedCache(layout, self.num_blocks, block_size, self.dtype, self.device)
        self.blocks = BlockPool(self.num_blocks)
        self.decode_sizes = decode_sizes(slots, rows)
        self.prefill_sizes = prefill_sizes(prompts, max_prompt, prefill_tokens or max_prompt)
        stop_width = len(config.eos_ids) + EXTRA_STOPS
        self.state = SlotState(slots, self.max_blocks, self.prefill_sizes[-1], stop_width,
                               config, self.model.vocab, self.device,
                               num_blocks=self.num_blocks, block_size=block_size)
        spec_sample = config.sampling.method == "sample"
        s = config.sampling
        self.sample = spec_sample if sample is None else sample
        self.filtered = ((spec_sample and (s.top_k > 0 or s.top_p < 1))
                         if filtered is None else filtered)
        self.admit_min = admit_min or max(1, slots // 16)
        self.compiled = CompiledStep(self.model, self.cache) if compile else None
        self.table = GraphTable(self._make_step, self.state, backend=backend,
                                device=self.device, dtype=self.dtype, pool=pool, verify=verify,
                                budget_bytes=None if budget is None else budget - self.kv_bytes,
                                log=self.log, compiled=compile)
        self.stats = GenerationStats(host_bound_steps=0 if self.cuda else None)
        self.table.prepare(self.keys(), "setup")
        self._free = list(range(slots))  # a heap: the lowest free slot first
        self._rows: list[_Row | None] = [None] * slots
        self._reserved = 0  # blocks the running rows may still take
        self._host_out = torch.zeros((RING, slots + 1), dtype=torch.int64, pin_memory=self.cuda)
        self._ring = 0
        self._last_event = None

    def keys(self) -> list[StepKey]:
        keys = [StepKey("prefill", t) for t in self.prefill_sizes]
        if self.config.max_new_tokens > 1:
            keys += [StepKey("decode", b) for b in self.decode_sizes]
        return keys

    def _make_step(self, key: StepKey, compiled: bool = False):
        model = self.compiled if compiled else self.model
        build = prefill_step if key.kind == "prefill" else decode_step
        return build(model, self.state, self.cache, self.config, key.size, sample=self.sample,
                     filtered=self.filtered)

    # -- requests ------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """One error for a prompt or parameters this engine cannot serve, naming the record."""
        n, rid = len(request.prompt), request.record_id
        if not 1 <= n <= self.max_prompt:
            raise GenerationError(
                f"record {rid!r}: its prompt has {n} tokens; give 1 to {self.max_prompt} (the "
                "longest prompt), truncated or rejected by the caller")
        p = request.params
        if p is None:
            return
        problems = []
        cap = self.config.max_new_tokens
        if p.max_new_tokens is not None and not 1 <= p.max_new_tokens <= cap:
            problems.append(f"max_new_tokens {p.max_new_tokens}: give 1 to the spec's {cap}")
        if p.temperature is not None and (p.temperature < 0 or (p.temperature > 0
                                                                and not self.sample)):
            problems.append(f"temperature {p.temperature}: this engine was built greedy; give "
                            "0 or build it with sample=True" if p.temperature > 0 else
                            f"temperature {p.temperature}: give 0 (greedy) or more")
        if ((p.top_k or 0) > 0 or (p.top_p is not None and p.top_p < 1)) and not self.filtered:
            problems.append("top_k / top_p: this engine was built without filtering (build it "
                            "with filtered=True)")
        if p.top_p is not None and not 0 < p.top_p <= 1:
            problems.append(f"top_p {p.top_p}: give a value in (0, 1]")
        if len(p.stop_token_ids) > EXTRA_STOPS or any(
                not 0 <= t < self.model.vocab for t in p.stop_token_ids):
            problems.append(f"stop_token_ids {list(p.stop_token_ids)}: at most {EXTRA_STOPS} "
                            "ids of the vocabulary")
        if problems:
            raise GenerationError(f"record {rid!r}: " + "; ".join(problems))

    def _settings(self, request: Request) -> tuple[int, float, int, float, int, tuple]:
        """(max_new, temperature, top_k, top_p, key, stops) of a request: its own, else the
        spec's."""
        c, s, p = self.config, self.config.sampling, request.params or RequestParams()
        greedy_spec = s.method == "greedy"
        temperature = p.temperature if p.temperature is not None else (
            0.0 if greedy_spec else s.temperature)
        seed = p.seed if p.seed is not None else s.seed
        stops = tuple(dict.fromkeys((*c.eos_ids, *p.stop_token_ids)))
        return (p.max_new_tokens or c.max_new_tokens, float(temperature),
                int(p.top_k if p.top_k is not None else (0 if greedy_spec else s.top_k)),
                float(p.top_p if p.top_p is not None else (1.0 if greedy_spec else s.top_p)),
                record_key(seed, request.record_id), stops)

    # -- the scheduler ---------------------------------------------------------------------------

    @torch.no_grad()
    def serve(self, take: Callable[[int, bool], list[Request] | None],
              emit: Callable[[Finished], None]) -> None:
        """Run until `take` says the input is over and every row has finished.

        take(n, block): up to n more requests ([] when none is ready and block is False;
        waits for one when block is True); None once no more will come. emit(finished): each
        completion, as it finishes (out of input order)."""
        waiting: deque[Request] = deque()
        inflight: deque[_Launch] = deque()
        ended = False
        while True:
            occupied = self.slots - len(self._free)
            if not ended and len(waiting) < len(self._free) + self.admit_min:
                idle = not occupied and not inflight and not waiting
                got = take(len(self._free) + self.admit_min - len(waiting), idle)
                if got is None:
                    ended = True
                else:
                    now = time.perf_counter()
                    for r in got:
                        self.check(r)
                        r.taken_s = now
                    waiting.extend(got)
            # prefills back to back while prompts and slots are left (the largest prefill may
            # not hold them all), so they join the same decode step
            while (waiting and self._free and len(inflight) < RING - 1
                   and (len(self._free) >= self.admit_min or ended or not occupied)):
                admitted = self._admit(waiting)
                if not admitted:
                    break
                inflight.append(self._prefill(admitted))
                occupied = self.slots - len(self._free)
            occupied = self.slots - len(self._free)
            stepped = occupied and self._wanted()
            if stepped:
                if not waiting:  # no prompt to refill with: the job's tail
                    self._compact()
                inflight.append(self._decode())
            elif not occupied and not inflight and not waiting and ended:
                return
            # the last launch stays unread while rows step: the device has it queued
            while len(inflight) > (1 if stepped else 0):
                self._read(inflight.popleft(), emit)

    def _admit(self, waiting: deque) -> list[_Row]:
        """The first waiting prompts that fit: a free slot each, their blocks (counting what
        every running row may still take), and the largest prefill."""
        rows, tokens = [], 0
        while waiting and self._free:
            r = waiting[0]
            n = len(r.prompt)
            max_new, *_ = self._settings(r)
            cap = -(-(n + max_new) // self.block_size)
            if self.blocks.free - self._reserved < cap or tokens + n > self.prefill_sizes[-1]:
                break
            waiting.popleft()
            tokens += n
            slot = heapq.heappop(self._free)
            first = min(cap, -(-(n + LOOKAHEAD) // self.block_size))
            row = _Row(r, slot, max_new, frozenset(), self.blocks.take(first), cap,
                       r.taken_s)
            self._reserved += cap - first
            self._rows[slot] = row
            rows.append(row)
        if not rows and not (self.slots - len(self._free)):
            r = waiting[0]
            raise GenerationError(f"record {r.record_id!r}: {len(r.prompt)} prompt tokens and "
                                  f"its max_new_tokens do not fit the {self.blocks.free} free KV "
                                  "blocks: give more blocks")
        return rows

    def _prefill(self, rows: list[_Row]) -> _Launch:
        """Pack the rows' prompts, write their slots' settings, replay the prefill graph."""
        st, host, bs = self.state, self.state.host, self.block_size
        total = sum(len(r.request.prompt) for r in rows)
        size = next(t for t in self.prefill_sizes if t >= total)
        n_max = st.p_join.numel()
        tokens = np.zeros(size, dtype=np.int64)
        positions = np.zeros(size, dtype=np.int64)
        segment = np.full(size, -1, dtype=np.int64)
        slots = np.zeros(size, dtype=np.int64)
        last = np.zeros(n_max, dtype=np.int64)
        join = np.full(n_max, st.spare, dtype=np.int64)
        lens = np.zeros(n_max, dtype=np.int32)
        at = 0
        for i, row in enumerate(rows):
            prompt = row.request.prompt
            n = len(prompt)
            max_new, temp, top_k, top_p, key, stops = self._settings(row.request)
            row.stops = frozenset(stops)
            s = row.slot
            host["block_table"][s] = 0
            host["block_table"][s, :len(row.blocks)] = row.blocks
            host["keys"][s], host["temperature"][s] = key, temp
            host["top_k"][s], host["top_p"][s], host["max_new"][s] = top_k, top_p, max_new
            host["stops"][s] = -1
            host["stops"][s, :len(stops)] = stops
            pos = np.arange(n)
            tokens[at:at + n] = prompt
            positions[at:at + n] = pos
            segment[at:at + n] = i
            slots[at:at + n] = np.asarray(row.blocks)[pos // bs] * bs + pos % bs
            last[i], join[i], lens[i] = at + n - 1, s, n
            at += n
        st.push()
        for name, values in (("p_tokens", tokens), ("p_positions", positions),
                             ("p_segment", segment), ("p_slots", slots), ("p_last", last),
                             ("p_join", join), ("p_lens", lens)):
            self._copy_in(getattr(st, name)[:len(values)], values)
        self.stats.prefills += 1
        self.stats.prefill_tokens += size
        return self._launch("prefill", StepKey("prefill", size), rows, len(rows))

    def _wanted(self) -> bool:
        """Whether a decode step makes a token some row may need: not when every row has
        been stepped up to its max_new_tokens already (it ends by length, read back soon)."""
        return any(r is not None and r.steps + 1 < r.max_new for r in self._rows)

    def _compact(self) -> None:
        """Move rows from the slots past the smallest decode graph that holds them all into
        free slots below it, so the tail of a job steps fewer rows. Rows whose prefill is not
        read back yet stay (the prefill may not have run): compaction waits for them."""
        rows = [r for r in self._rows if r is not None]
        fits = next(n for n in self.decode_sizes if n >= len(rows))
        high = [r for r in rows if r.slot >= fits]
        if not high or any(not r.joined for r in high):
            return
        low = sorted(s for s in self._free if s < fits)[:len(high)]
        st, host = self.state, self.state.host
        src, dst = [r.slot for r in high], low
        for r, to in zip(high, dst):
            for name in HOST_FIELDS:
                host[name][to] = host[name][r.slot]
            host["block_table"][r.slot] = 0
            self._rows[to], self._rows[r.slot] = r, None
            r.slot = to
        self._free = sorted((set(self._free) - set(dst)) | set(src))  # sorted: a heap
        st.push()
        frm = torch.tensor(src, dtype=torch.int64)
        to = torch.tensor(dst, dtype=torch.int64)
        if self.cuda:
            frm = frm.pin_memory().to(self.device, non_blocking=True)
            to = to.pin_memory().to(self.device, non_blocking=True)
        for name in ("token", "seq_lens", "index", "done"):  # the device's own values, moved
            t = getattr(st, name)
            t.index_copy_(0, to, t.index_select(0, frm))
        st.done.index_fill_(0, frm, True)
        self.stats.moved_rows += len(src)

    def _decode(self) -> _Launch:
        """Grow the rows whose blocks would not cover the next steps, then one decode step over
        the smallest graph covering the highest occupied slot."""
        st, bs = self.state, self.block_size
        top = max(r.slot for r in self._rows if r is not None) + 1
        b = next(s for s in self.decode_sizes if s >= top)
        grown, keys = False, 0
        for row in self._rows[:b]:
            if row is None:
                continue
            row.steps += 1
            length = len(row.request.prompt) + row.steps  # keys after this step, at most
            keys += length
            if len(row.blocks) * bs < length and len(row.blocks) < row.cap:
                want = min(row.cap, -(-(length + LOOKAHEAD) // bs))
                more = self.blocks.take(want - len(row.blocks))
                self._reserved -= len(more)
                st.host["block_table"][row.slot, len(row.blocks):want] = more
                row.blocks += more
                grown = True
        if grown:
            st.push(("block_table",))
        occupied = self.slots - len(self._free)
        self.stats.stepped(b, occupied, self.blocks.used, keys)
        return self._launch("decode", StepKey("decode", b), list(self._rows[:b]), b)

    def _copy_in(self, target: torch.Tensor, values: np.ndarray) -> None:
        source = torch.from_numpy(values)
        if self.cuda:
            source = source.pin_memory()
        target.copy_(source, non_blocking=True)

    def _launch(self, kind: str, key: StepKey, rows: list, count: int) -> _Launch:
        buffer = self._ring
        self._ring = (self._ring + 1) % RING
        timing = None
        t0 = time.perf_counter()
        if self.cuda:
            if kind == "decode" and self._last_event is not None and self._last_event.query():
                self.stats.host_bound_steps += 1  # the device had nothing queued: it waited
            timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timing[0].record()
        self.table[key].run()
        out = self._host_out[buffer, :count]
        out.copy_(self.state.picked[:count], non_blocking=True)
        event = None
        if self.cuda:
            timing[1].record()
            event = torch.cuda.Event()
            event.record()
            self._last_event = event
        return _Launch(kind, rows, buffer, event, timing, time.perf_counter() - t0)

    def _read(self, launch: _Launch, emit: Callable[[Finished], None]) -> None:
        """A launch's picked tokens, once there: each row's token appended; a row that
        stopped leaves."""
        if launch.event is not None:
            launch.event.synchronize()
            seconds = launch.timing[0].elapsed_time(launch.timing[1]) / 1e3
        else:
            seconds = launch.host_s
        out = self._host_out[launch.buffer].numpy()
        now = time.perf_counter()
        if launch.kind == "prefill":
            self.stats.prefill_s += seconds
            for i, row in enumerate(launch.rows):
                row.joined, row.first_s = True, now
                self.stats.ttft.add(now - row.taken_s)
                self._append(row, int(out[i]), emit, now)
            return
        self.stats.decode_s += seconds
        for i, row in enumerate(launch.rows):
            if row is not None and row.joined and self._rows[row.slot] is row:
                self._append(row, int(out[i]), emit, now)

    def _append(self, row: _Row, token: int, emit, now: float) -> None:
        row.tokens.append(token)
        if token in row.stops:
            reason = "eos"
        elif len(row.tokens) >= row.max_new:
            reason = "length"
        else:
            return
        self._finish(row, reason, emit, now)

    def _finish(self, row: _Row, reason: str, emit, now: float) -> None:
        n = len(row.tokens)
        if n > 1:
            self.stats.tpot.add((now - row.first_s) / (n - 1))
        self.stats.finished(len(row.request.prompt), n, reason)
        self.blocks.give(row.blocks)
        self._reserved -= row.cap - len(row.blocks)
        self.state.host["block_table"][row.slot] = 0
        self._rows[row.slot] = None
        heapq.heappush(self._free, row.slot)
        emit(Finished(row.request, Completion(row.tokens, reason, len(row.request.prompt), n)))

    # -- a whole list at once (tests, benchmarks, validate --load) --------------------------------

    def generate(self, prompts: list[list[int]], record_ids: list | None = None,
                 params: list[RequestParams | None] | None = None) -> list[Completion]:
        """Completions of the prompts, in their order."""
        ids = list(range(len(prompts))) if record_ids is None else list(record_ids)
        params = params or [None] * len(prompts)
        if len(ids) != len(prompts) or len(params) != len(prompts):
            raise GenerationError(f"generate: {len(prompts)} prompts, {len(ids)} record ids and "
                                  f"{len(params)} parameters: give one of each per prompt")
        source = deque(Request(list(p), i, q, tag=k)
                       for k, (p, i, q) in enumerate(zip(prompts, ids, params)))
        done: list[Completion | None] = [None] * len(prompts)

        def take(n: int, block: bool):
            if not source:
                return None
            return [source.popleft() for _ in range(min(n, len(source)))]

        self.serve(take, lambda f: done.__setitem__(f.request.tag, f.completion))
        return done

    def graphs(self) -> list[dict]:
        """Per graph set up: kind, shape, status, capture time, memory, verification."""
        return [entry.describe() for entry in self.table.entries.values()]

    def close(self) -> None:
        """Drop the graphs and buffers; a transformers model gets its attention back."""
        self._close_model()
        self.table.entries.clear()
        self.cache = self.state = None


def build_engine(model, config: GenerateConfig, *, slots: int, max_prompt: int, device="cpu",
                 dtype=torch.float32, backend: str | None = None, **kwargs) -> Engine:
    """An Engine with the backend its device allows: captured graphs on a GPU, else eager."""
    device = torch.device(device)
    backend = backend or ("cuda-graph" if device.type == "cuda" else "eager")
    return Engine(model, config=config, slots=slots, max_prompt=max_prompt, device=device,
                  dtype=dtype, backend=backend, **kwargs)
