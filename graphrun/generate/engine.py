"""The generation engine: a pool of decode slots, a scheduler that admits prompts as slots free
up, a packed prefill, then the decode steps that every occupied slot takes together.

It owns the static state of generation on one device: the paged KV cache (models/causal/kv_cache.py), the
slot buffers (steps.py) and the graph table (graphs.py): one decode graph per row count (a few
sizes up to the slots, for the job's tail) and one prefill graph per packed token count.

The scheduler's loop (serve), on one thread:
1. take prompts from the source while slots are free, and with the prefix cache until a
   window of them waits (blocking only when nothing runs);
2. admit: waiting prompts into the lowest free slots, as many as the free slots, the blocks
   and the largest prefill allow, in input order except that, with the prefix cache, those
   whose opening is cached go first within a look-ahead window (no prompt is overtaken by more
   than the window); they are packed into one sequence and prefilled, which
   writes their keys into their blocks and picks each one's first token (prefill then join: the
   decode step stays one uniform graph, see docs/architecture.md);
3. decode: the smallest decode graph covering the highest occupied slot, after growing any row
   whose blocks would not cover the next steps (and, in the job's tail, when no prompt waits,
   after moving rows down to the lowest free slots, so the graph shrinks with them);
4. read back the output of the launch before the last: each launch copies its picked tokens to
   pinned host memory behind an event, and the host waits on the previous launch's event only
   after the next is queued, so the device always has a step queued. The host then appends each
   row's token, and a row that stopped (a stop id, a stop string in its text (stop_text.py),
   or its max_new_tokens) leaves at once: its completion goes to the caller, its blocks back to
   the pool, its slot to the next prompt.

A request for n samples is n rows (sample 0 to n-1); the samples admitted together are packed
once, each picking its own first token from the prompt's logits; the others hold a reference to
each of the prompt's full KV blocks (BlockPool counts them) and a copy of its last block where
that is partial (their decode steps write their own tokens after the prompt's there). A record's
tokens depend only on the model, its prompt and (seed, record id, sample index, position): its
slot, its neighbours and when it was admitted change nothing (sampling.py).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

import numpy as np
import torch

from graphrun.base.dtypes import torch_dtype
from graphrun.base.phases import phase
from graphrun.base.units import MiB
from graphrun.spec.request import EXTRA_STOPS, RequestParams

from graphrun.generate.compiled import CompiledStep
from graphrun.generate.config import Completion, GenerateConfig, GenerationError, check_config
from graphrun.generate.graphs import GraphTable, StepKey
from graphrun.models.causal.hf_attention import HFCausalLM, is_hf_model, unsupported
from graphrun.models.causal.kv_cache import BlockPool, PagedCache, chain_hashes
from graphrun.models.causal.llama import Llama, OwnLM
from graphrun.models.causal.warm import attention_plans, layout_of
from graphrun.generate.sampling import record_key
from graphrun.generate.stats import GenerationStats
from graphrun.generate.steps import (HOST_FIELDS, ROW_FIELDS, SlotState, Variant, check_kernels,
                                     decode_step, prefill_step)
from graphrun.generate.stop_text import StopText

LOOKAHEAD = 16  # decode steps a row's blocks cover ahead: block growth is not per token
AUTO_SLOTS = 256  # slots: auto at most (more rows per step than decode benefits from)
AUTO_MEMORY = 0.5  # slots: auto takes this share of the device memory left for the KV cache
RING = 4  # pinned output buffers: launches unread at most
WINDOW = 32  # waiting prompts the scheduler looks ahead over, and may let overtake one
ADMIT_SHARE = 16  # a prefill waits for 1/ADMIT_SHARE of the slots to be free while rows run
ADMIT_WAIT = 8  # ... or for this many decode steps since a slot freed, when fewer free up
# below this many rows a step reads the weights in about the same time whatever its rows, so
# a halfway graph there would only add set-up; the tail steps few times at such sizes
HALVES_FROM = 16


def admit_least(slots: int) -> int:
    """Free slots a prefill waits for while rows decode: prefills few and full rather than one
    per finished row, each one a launch between decode steps. Where rows end together (every
    completion max_new_tokens long), fewer may free up for many steps: after ADMIT_WAIT decode
    steps those are filled anyway (Engine._waited)."""
    return max(1, slots // ADMIT_SHARE)


@dataclass
class Request:
    """One prompt for the engine; `tag` is the caller's (where the completion goes)."""

    prompt: list[int]
    record_id: object
    params: RequestParams | None = None
    tag: object = None
    taken_s: float = 0.0  # when the engine took it (its TTFT counts from here)
    sample: int = 0  # which of its n samples (the engine makes one request per sample)
    passed: int = 0  # prompts after it admitted before it (Engine._admit)
    chain: list[bytes] | None = field(default=None, repr=False)  # its full blocks' keys


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
    reused: int = 0  # leading blocks shared from the prefix cache, not prefilled
    steps: int = 0  # decode steps launched since its prefill
    tokens: list[int] = field(default_factory=list)
    first_s: float = 0.0
    logprobs: int | None = None  # its top alternatives per token; None: none asked
    packed_at: int = 0  # where its prompt starts in its prefill's pack
    prompt_logprobs: list[float] | None = None
    token_logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    text: StopText | None = None  # with stop strings: its text so far


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
    """The decode graphs' row counts: those given (up to the slots), else powers of two, with
    the halfway points between them from HALVES_FROM rows on (a step there pads a third of its
    rows at most); the slots themselves always."""
    given = sorted({s for s in (sizes or []) if 1 <= s <= slots})
    if not given:
        n = 1
        while n < slots:
            given += [n, n + n // 2] if n >= HALVES_FROM else [n]
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
    """Slots, blocks, graphs and the scheduler over them (module docstring). warm: the kernels'
    warm-up begun for this model (models/causal/warm.WarmUp), waited for before the first
    graph is set up."""

    def __init__(self, model, *, config: GenerateConfig, slots: int | str, max_prompt: int,
                 device, dtype, backend: str, block_size: int = 16,
                 num_blocks: int | None = None, rows: Iterable[int] | None = None,
                 prompts: Iterable[int] | None = None, prefill_tokens: int | None = None,
                 pool=None, verify: bool = True,
                 memory_budget_mib=None, compile: bool = False, sample: bool | None = None,
                 filtered: bool | None = None, penalized: bool | None = None,
                 logprobs: int | None | str = "spec", admit_min: int | None = None,
                 prefix_cache: bool = True, window: int = WINDOW,
                 detokenize: Callable[[list[int]], str] | None = None,
                 log: Callable[[str], None] | None = None,
                 compiler: Callable = CompiledStep, warm=None):
        """compiler(model, cache): the step model that compile=True runs (compiled.py)."""
        self.config, self.log, self.warm = config, log or (lambda line: None), warm
        self.detokenize = detokenize  # token ids -> text, for stop strings
        if config.stop_strings and detokenize is None:
            raise GenerationError("generate: stop strings need the tokenizer's decode: give "
                                  "the engine detokenize")
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
            rows = None if self.cuda else rows  # a GPU's: a ladder up to what memory allows
        if slots < 1:
            raise GenerationError(f"generate: slots is {slots}: give at least 1")
        self.slots, self.max_prompt, self.block_size = slots, max_prompt, block_size
        self.num_blocks = num_blocks or slots * self.max_blocks + 1
        if self.num_blocks < self.max_blocks + 1:
            raise GenerationError(
                f"generate: {self.num_blocks} KV blocks cannot hold one record of "
                f"{self.max_len} tokens ({self.max_blocks} blocks of {block_size}, and the "
                f"trash block): give {self.max_blocks + 1} blocks or more, or a smaller "
                "max_new_tokens")
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
        # cached blocks one prefill reads at most: one longest prompt's, its last token's
        # block excluded (always computed: its logits pick the first new token)
        # a shared prefix's tokens are not computed: no prompt logprobs for them, and a
        # sliding window's mask over cached keys is not built
        prefix_cache = (prefix_cache and not config.prompt_logprobs
                        and getattr(self.model, "window", None) is None)
        self.prefix_blocks = (max_prompt - 1) // block_size if prefix_cache else 0
        self.window = window if self.prefix_blocks else 0  # look-ahead for cached openings
        stop_width = len(config.eos_ids) + EXTRA_STOPS
        spec_sample = config.sampling.method == "sample"
        s = config.sampling
        # what the steps compute: the spec's needs, or what records may ask (runner's
        # per_row_choices); logprobs: the most top alternatives a row may ask
        self.variant = Variant(
            sample=spec_sample if sample is None else sample,
            filtered=((spec_sample and (s.top_k > 0 or s.top_p < 1 or s.min_p > 0))
                      if filtered is None else filtered),
            penalized=s.penalized if penalized is None else penalized,
            logprobs=config.logprobs if logprobs == "spec" else logprobs,
            prompt_logprobs=config.prompt_logprobs)
        self.sample, self.filtered = self.variant.sample, self.variant.filtered
        self.state = SlotState(slots, self.max_blocks, self.prefill_sizes[-1], stop_width,
                               config, self.model.vocab, self.device,
                               num_blocks=self.num_blocks, block_size=block_size,
                               variant=self.variant, prefix_blocks=self.prefix_blocks)
        self.admit_min = admit_min or admit_least(slots)
        self._free_since: int | None = None  # the decode step a slot freed at, since a prefill
        self.compiled = compiler(self.model, self.cache) if compile else None
        self.table = GraphTable(self._make_step, self.state, backend=backend,
                                device=self.device, dtype=self.dtype, pool=pool, verify=verify,
                                budget_bytes=None if budget is None else budget - self.kv_bytes,
                                log=self.log, compiled=compile)
        self.stats = GenerationStats(host_bound_steps=0 if self.cuda else None)
        self._attention_plans()
        self._wait_for_warm_up()
        if self.cuda:  # done on the warm-up's thread where one ran: then free here
            check_kernels(self.device, self.model.vocab)
        self.table.prepare(self.keys(), "setup")
        self._free = list(range(slots))  # a heap: the lowest free slot first
        self._rows: list[_Row | None] = [None] * slots
        self._reserved = 0  # blocks the running rows may still take
        self._make_host_rings(slots)

    def _attention_plans(self) -> None:
        """While the kernels' warm-up runs, and only then, this thread's attention plans for
        the prefill graphs (warm.attention_plans: torch keeps them per thread); graphrun's
        models only, the ones the warm-up knows."""
        if not (self.cuda and self.warm is not None and self.warm.status == "running"
                and isinstance(self.model, OwnLM)):
            return
        with phase("attention plans"):
            attention_plans(layout_of(self.model.shape), self.device, self.dtype,
                            self.prefill_sizes, until=lambda: self.warm.status != "running")

    def _wait_for_warm_up(self) -> None:
        """The kernels' warm-up ended (its failure only said: the steps compile anew)."""
        if self.warm is None:
            return
        with phase("kernel warm-up"):
            self.warm.wait()
        if self.warm.status == "failed":
            self.log(f"warning: the kernels' warm-up failed, the graphs' set-up compiles them: "
                     f"{self.warm.reason}")

    def _make_host_rings(self, slots: int) -> None:
        """The pinned host buffers each launch copies its outputs into, RING deep, so the host
        reads a launch only after the next one is queued."""
        def ring(*shape, dtype) -> torch.Tensor:
            return torch.zeros((RING, *shape), dtype=dtype, pin_memory=self.cuda)

        top = self.variant.logprobs or 0  # the picked token's logprob, the top's, their ids
        self._host_out = ring(slots + 1, dtype=torch.int64)
        self._host_lp = ring(slots + 1, 1 + top, dtype=torch.float32)
        self._host_ids = ring(slots + 1, top, dtype=torch.int64)
        self._host_prompt = ring(self.state.p_logprobs.numel(), dtype=torch.float32)
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
        return build(model, self.state, self.cache, self.config, key.size, self.variant)

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
        if p.min_p is not None and not 0 <= p.min_p <= 1:
            problems.append(f"min_p {p.min_p}: give a value in [0, 1]")
        elif (p.min_p or 0) > 0 and not self.filtered:
            problems.append("min_p: this engine was built without filtering (build it with "
                            "filtered=True)")
        penalties = (p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
        if not self.variant.penalized and any(
                v is not None and v != off for v, off in zip(penalties, (1.0, 0.0, 0.0))):
            problems.append("repetition / presence / frequency penalty: this engine was built "
                            "without penalties (build it with penalized=True)")
        if p.repetition_penalty is not None and not p.repetition_penalty > 0:
            problems.append(f"repetition_penalty {p.repetition_penalty}: give a value > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(p, name)
            if v is not None and not -2 <= v <= 2:
                problems.append(f"{name} {v}: give a value in [-2, 2]")
        if p.logprobs is not None and not 0 <= p.logprobs <= (self.variant.logprobs or 0):
            width = self.variant.logprobs
            problems.append(f"logprobs {p.logprobs}: " + (
                "this engine computes no log-probabilities (build it with logprobs=k)"
                if width is None else f"give 0 to {width} (the engine's logprobs)"))
        if len(p.stop_token_ids) > EXTRA_STOPS or any(
                not 0 <= t < self.model.vocab for t in p.stop_token_ids):
            problems.append(f"stop_token_ids {list(p.stop_token_ids)}: at most {EXTRA_STOPS} "
                            "ids of the vocabulary")
        if p.stop_strings and (self.detokenize is None or not all(
                isinstance(t, str) and t for t in p.stop_strings)):
            problems.append(f"stop strings {list(p.stop_strings)}: non-empty strings, on an "
                            "engine given detokenize")
        if p.n is not None and p.n < 1:
            problems.append(f"n {p.n}: give 1 or more samples")
        if problems:
            raise GenerationError(f"record {rid!r}: " + "; ".join(problems))

    def _row_sampling(self, request: Request) -> tuple[float, float, float, float, int | None]:
        """(min_p, repetition, presence, frequency, logprobs) of a request: its own, else the
        spec's (min_p only where it samples; logprobs the spec's for every record)."""
        s, p = self.config.sampling, request.params or RequestParams()

        def own(name: str, spec_value: float) -> float:
            v = getattr(p, name)
            return float(spec_value if v is None else v)

        min_p = own("min_p", s.min_p if s.method == "sample" else 0.0)
        logprobs = p.logprobs if p.logprobs is not None else self.config.logprobs
        return (min_p, own("repetition_penalty", s.repetition_penalty),
                own("presence_penalty", s.presence_penalty),
                own("frequency_penalty", s.frequency_penalty), logprobs)

    def samples_of(self, params: RequestParams | None) -> int:
        """How many samples a request asks for: its own n, else the spec's."""
        own = params.n if params is not None else None
        return self.config.n if own is None else own

    def _packs_once(self, request: Request) -> int:
        """The key under which a prompt's samples are prefilled once (its list's id); under
        penalties each sample is packed on its own, so that its prefill marks its own row's
        prompt tokens."""
        return id(request) if self.variant.penalized else id(request.prompt)

    def samples(self, request: Request) -> list[Request]:
        """A request as its n samples, in index order."""
        n = self.samples_of(request.params)
        return [request] if n == 1 else [replace(request, sample=k) for k in range(n)]

    def _settings(self, request: Request) -> tuple[int, float, int, float, int, tuple]:
        """(max_new, temperature, top_k, top_p, key, stop ids) of a request: its own, else the
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
                record_key(seed, request.record_id, request.sample), stops)

    def _stop_text(self, request: Request) -> StopText | None:
        """A row's text watch: the spec's stop strings and the request's own."""
        own = request.params.stop_strings if request.params is not None else ()
        strings = tuple(dict.fromkeys((*self.config.stop_strings, *own)))
        return StopText(strings, self.detokenize) if strings else None

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
            want = max(len(self._free) + self.admit_min, self.window)
            if not ended and len(waiting) < want:
                idle = not occupied and not inflight and not waiting
                got = take(want - len(waiting), idle)
                if got is None:
                    ended = True
                else:
                    now = time.perf_counter()
                    for r in got:
                        self.check(r)
                        r.taken_s = now
                        waiting.extend(self.samples(r))
            # prefills back to back while prompts and slots are left (the largest prefill may
            # not hold them all), so they join the same decode step
            while (waiting and self._free and len(inflight) < RING - 1
                   and (len(self._free) >= self.admit_min or ended or not occupied
                        or self._waited())):
                admitted = self._admit(waiting)
                self._free_since = self.stats.decode_steps if self._free else None
                if not admitted:
                    break
                inflight.append(self._prefill(admitted))
                occupied = self.slots - len(self._free)
            occupied = self.slots - len(self._free)
            stepped = occupied and self._wanted()
            if stepped:
                if not waiting:  # no prompt to refill with: the job's tail
                    self._compact()
                inflight.append(self._decode(waiting=bool(waiting)))
            elif not occupied and not inflight and not waiting and ended:
                return
            # the last launch stays unread while rows step: the device has it queued
            while len(inflight) > (1 if stepped else 0):
                self._read(inflight.popleft(), emit)

    def _waited(self) -> bool:
        """A slot has been free for ADMIT_WAIT decode steps without admit_min gathering: rows
        that end together leave too few free slots for many steps."""
        return (self._free_since is not None
                and self.stats.decode_steps - self._free_since >= ADMIT_WAIT)

    def _admit(self, waiting: deque) -> list[_Row]:
        """The waiting prompts that fit, in the scheduler's order (_order): a free slot each,
        their blocks (counting what every running row may still take), and the largest
        prefill; the first that does not fit ends the prefill. A prompt's leading full blocks
        found in the prefix cache are shared, the rest taken, and its full blocks registered
        as they will be computed; a prompt that would share a block this same prefill computes
        waits for the next prefill, which reads it, and the prompts after it go on (what a
        record generates does not depend on when it is admitted). A prompt's samples admitted
        together count its tokens once: _prefill packs it once, the other samples hold a
        reference to each of its full blocks, and its last block, if partial, is copied to
        theirs (the decode steps write each sample's own tokens after the prompt there)."""
        rows, tokens, bs = [], 0, self.block_size
        computed: set[int] = set()  # blocks this prefill registers
        prefix: dict[int, None] = {}  # cached blocks this prefill reads
        packed: dict[int, _Row] = {}  # prompts (_packs_once) this prefill computes: the row
        queue = list(waiting)  # in input order
        admitted: set[int] = set()
        for i in self._order(queue):
            if not self._free:
                break
            r = queue[i]
            n = len(r.prompt)
            max_new, *_ = self._settings(r)
            cap = -(-(n + max_new) // bs)
            computing = packed.get(self._packs_once(r))
            if computing is None:
                keys = self._chain(r)
                shared = self.blocks.lookup(keys[:(n - 1) // bs])
                if computed.intersection(shared):  # the next prefill reads what this one writes
                    continue
                read, more = shared, n - len(shared) * bs
            else:  # another sample of a prompt this prefill computes: its full blocks shared
                keys, shared, read, more = [], computing.blocks[:n // bs], [], 0
            if (len(prefix.keys() | set(read)) > self.prefix_blocks
                    or self.blocks.free - self.blocks.idle_among(shared) - self._reserved
                    < cap - len(shared)
                    or tokens + more > self.prefill_sizes[-1]):
                break
            admitted.add(i)
            tokens += more
            slot = heapq.heappop(self._free)
            held = min(cap, -(-(n + LOOKAHEAD) // bs))
            self.blocks.share(shared)
            blocks = shared + self.blocks.take(held - len(shared))
            for j in range(len(shared), len(keys)):
                if self.blocks.register(blocks[j], keys[j]):
                    computed.add(blocks[j])
            prefix.update(dict.fromkeys(read))
            row = _Row(r, slot, max_new, frozenset(), blocks, cap, r.taken_s,
                       reused=len(read), text=self._stop_text(r))
            packed.setdefault(self._packs_once(r), row)
            self._reserved += cap - held
            self._rows[slot] = row
            rows.append(row)
        waiting.clear()
        later = 0  # admitted prompts after this one in input order: it was overtaken by them
        for i in range(len(queue) - 1, -1, -1):
            if i in admitted:
                later += 1
            else:
                queue[i].passed += later
        waiting.extend(r for i, r in enumerate(queue) if i not in admitted)
        if not rows and not (self.slots - len(self._free)):
            r = waiting[0]
            raise GenerationError(f"record {r.record_id!r}: {len(r.prompt)} prompt tokens and "
                                  f"its max_new_tokens do not fit the {self.blocks.free} free KV "
                                  "blocks: give more blocks")
        return rows

    def _order(self, queue: list[Request]) -> list[int]:
        """The order prompts are tried in, to raise reuse without holding any prompt back for
        long: first those overtaken by `window` later prompts already, then, among the first
        `window`, those whose leading block is cached now (they compute less, and are read
        before the pool may evict their blocks), then the rest; input order within each. A
        prompt sharing an uncached opening with one this prefill computes waits (_admit), so
        it comes first in the next, cached then."""
        def rank(i: int) -> int:
            r = queue[i]
            if r.passed >= self.window:
                return 0
            shareable = (self._chain(r)[:(len(r.prompt) - 1) // self.block_size]
                         if i < self.window else [])
            return 1 if self.blocks.lookup(shareable[:1]) else 2

        return sorted(range(len(queue)), key=lambda i: (rank(i), i))

    def _chain(self, request: Request) -> list[bytes]:
        """The chain hashes of a prompt's full blocks, computed once; none without a cache."""
        if not self.prefix_blocks:
            return []
        if request.chain is None:
            request.chain = chain_hashes(request.prompt, self.block_size,
                                         len(request.prompt) // self.block_size)
        return request.chain

    def _prefill(self, rows: list[_Row]) -> _Launch:
        """Pack the rows' prompts, write their slots' settings, replay the prefill graph (or
        run the prefill eagerly where it reads cached blocks)."""
        st, host, bs = self.state, self.state.host, self.block_size
        computes: dict[int, int] = {}  # each prompt packed once: its tokens not cached
        for r in rows:
            computes.setdefault(self._packs_once(r.request),
                                len(r.request.prompt) - r.reused * bs)
        total = sum(computes.values())
        size = next(t for t in self.prefill_sizes if t >= total)
        n_max = st.p_join.numel()
        tokens = np.zeros(size, dtype=np.int64)
        positions = np.zeros(size, dtype=np.int64)
        segment = np.full(size, -1, dtype=np.int64)
        starts = np.full(n_max + 2, size, dtype=np.int32)  # the padding's, then the pack's end
        cuts = 0  # prompts packed so far
        slots = np.zeros(size, dtype=np.int64)
        last = np.zeros(n_max, dtype=np.int64)
        join = np.full(n_max, st.spare, dtype=np.int64)
        lens = np.zeros(n_max, dtype=np.int32)
        prefix = np.zeros(self.prefix_blocks, dtype=np.int64)
        depth = np.zeros(self.prefix_blocks, dtype=np.int64)
        read: dict[int, int] = {}  # cached block -> its depth, each once
        at = 0
        # the samples of one prompt (Engine.samples: one prompt list) packed once: id(prompt)
        # -> (its last token's place in the pack, the row whose blocks its keys go to)
        packed: dict[int, tuple[int, _Row]] = {}
        src, dst = [], []  # a prompt's partial last block, copied to its other samples' after
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
            (host["min_p"][s], host["repetition"][s], host["presence"][s],
             host["frequency"][s], row.logprobs) = self._row_sampling(row.request)
            once = self._packs_once(row.request)
            if once in packed:
                place, first = packed[once]
                last[i], join[i], lens[i] = place, s, n
                row.packed_at = first.packed_at
                if n % bs:  # its full blocks are the first's; the partial one its own copy
                    src.append(first.blocks[n // bs])
                    dst.append(row.blocks[n // bs])
                continue
            read.update((b, j) for j, b in enumerate(row.blocks[:row.reused]))
            start = row.reused * bs  # the shared blocks' tokens are not packed
            pos = np.arange(start, n)
            m = n - start
            packed[once] = (at + m - 1, row)
            tokens[at:at + m] = prompt[start:]
            positions[at:at + m] = pos
            segment[at:at + m] = i
            starts[cuts], cuts = at, cuts + 1
            slots[at:at + m] = np.asarray(row.blocks)[pos // bs] * bs + pos % bs
            last[i], join[i], lens[i] = at + m - 1, s, n
            row.packed_at = at
            at += m
            self.stats.prompt_computed += m
            self.stats.prompt_reused += start
        starts[cuts] = at
        prefix[:len(read)] = list(read)
        depth[:len(read)] = list(read.values())
        st.push()
        for name, values in (("p_tokens", tokens), ("p_positions", positions),
                             ("p_segment", segment), ("p_starts", starts),
                             ("p_slots", slots), ("p_last", last),
                             ("p_join", join), ("p_lens", lens), ("p_prefix", prefix),
                             ("p_depth", depth)):
            self._copy_in(getattr(st, name)[:len(values)], values)
        self.stats.prefills += 1
        self.stats.prefill_tokens += size
        launch = self._launch("prefill", StepKey("prefill", size), rows, len(rows),
                              self._reading_step(rows, size, len(read)) if read else None)
        if src:
            self._copy_blocks(src, dst)
        return launch

    def _reading_step(self, rows: list[_Row], size: int, width: int) -> Callable[[], None]:
        """The prefill of `size` tokens that reads `width` cached blocks, run eagerly: the
        captured prefills read none, so a prefill without hits pays nothing for the cache."""
        self.stats.reading_prefills += 1
        return prefill_step(self.model, self.state, self.cache, self.config, size,
                            self.variant, prefix=width, unpacked=self._unpacked(rows))

    def _unpacked(self, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(slots, tokens) of the prompt tokens the rows read from the cache instead of
        packing them, for the penalties (a prompt's every token counts as seen); None
        where no row may be penalized."""
        if not self.variant.penalized:
            return None
        bs = self.block_size
        slots = [r.slot for r in rows for _ in range(r.reused * bs)]
        tokens = [t for r in rows for t in r.request.prompt[:r.reused * bs]]
        return tuple(self._to_device(v) for v in (slots, tokens))

    def _copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Blocks' keys and values into other blocks, in stream order (after the prefill that
        wrote them, before the decode that reads them)."""
        frm, to = self._to_device(src), self._to_device(dst)
        for t in (*self.cache.k, *self.cache.v):
            t.index_copy_(0, to, t.index_select(0, frm))
        self.stats.copied_blocks += len(src)

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """Host ints as an int64 tensor on the device, in stream order (pinned: the host does
        not wait for the queued steps)."""
        t = torch.tensor(values, dtype=torch.int64)
        return t.pin_memory().to(self.device, non_blocking=True) if self.cuda else t

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
        frm, to = self._to_device(src), self._to_device(dst)
        for name in ROW_FIELDS:  # the device's own values, moved
            t = getattr(st, name)
            t.index_copy_(0, to, t.index_select(0, frm))
        st.done.index_fill_(0, frm, True)
        self.stats.moved_rows += len(src)

    def _decode(self, waiting: bool = False) -> _Launch:
        """Grow the rows whose blocks would not cover the next steps, then one decode step over
        the smallest graph covering the highest occupied slot (waiting: prompts wait to be
        admitted, counted for the waste's causes)."""
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
        self.stats.stepped(b, occupied, self.blocks.used, keys, waiting)
        return self._launch("decode", StepKey("decode", b), list(self._rows[:b]), b)

    def _copy_in(self, target: torch.Tensor, values: np.ndarray) -> None:
        source = torch.from_numpy(values)
        if self.cuda:
            source = source.pin_memory()
        target.copy_(source, non_blocking=True)

    def _launch(self, kind: str, key: StepKey, rows: list, count: int,
                step: Callable[[], None] | None = None) -> _Launch:
        """The key's graph (or `step`, run eagerly in its place) queued, its outputs copied to
        the next pinned buffer."""
        buffer = self._ring
        self._ring = (self._ring + 1) % RING
        timing = None
        t0 = time.perf_counter()
        if self.cuda:
            if kind == "decode" and self._last_event is not None and self._last_event.query():
                self.stats.host_bound_steps += 1  # the device had nothing queued: it waited
            timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timing[0].record()
        (step or self.table[key].run)()
        out = self._host_out[buffer, :count]
        out.copy_(self.state.picked[:count], non_blocking=True)
        if kind == "prefill" and self.variant.prompt_logprobs:
            size = key.size
            self._host_prompt[buffer, :size].copy_(self.state.p_logprobs[:size],
                                                   non_blocking=True)
        if self.variant.logprobs is not None:
            self._host_lp[buffer, :count].copy_(self.state.logprobs[:count], non_blocking=True)
            self._host_ids[buffer, :count].copy_(self.state.top_ids[:count], non_blocking=True)
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
        if self.variant.logprobs is not None:
            self._keep_logprobs(launch)
        now = time.perf_counter()
        if launch.kind == "prefill":
            self.stats.prefill_s += seconds
            scored = self._host_prompt[launch.buffer].numpy()
            for i, row in enumerate(launch.rows):
                if self.variant.prompt_logprobs:  # token t's logprob sits at t - 1
                    at, n = row.packed_at, len(row.request.prompt)
                    row.prompt_logprobs = scored[at:at + n - 1].tolist()
                row.joined, row.first_s = True, now
                self.stats.ttft.add(now - row.taken_s)
                self._append(row, int(out[i]), emit, now)
            return
        self.stats.decode_s += seconds
        for i, row in enumerate(launch.rows):
            if row is not None and row.joined and self._rows[row.slot] is row:
                self._append(row, int(out[i]), emit, now)

    def _keep_logprobs(self, launch: _Launch) -> None:
        """Each asking row's logprobs of this launch's token, before _append may finish it."""
        lp, ids = self._host_lp[launch.buffer].numpy(), self._host_ids[launch.buffer].numpy()
        for i, row in enumerate(launch.rows):
            if (row is None or row.logprobs is None or (launch.kind == "decode" and not (
                    row.joined and self._rows[row.slot] is row))):
                continue
            k = row.logprobs
            row.token_logprobs.append(float(lp[i, 0]))
            row.top_logprobs.append(lp[i, 1:1 + k].tolist())
            row.top_ids.append(ids[i, :k].tolist())

    def _append(self, row: _Row, token: int, emit, now: float) -> None:
        row.tokens.append(token)
        if token in row.stops:
            reason = "eos"
        elif row.text is not None and row.text.feed(row.tokens):
            reason = "stop"
        elif len(row.tokens) >= row.max_new:
            reason = "length"
        else:
            return
        self._finish(row, reason, emit, now)

    def _finish(self, row: _Row, reason: str, emit, now: float) -> None:
        n = len(row.tokens)
        if reason == "stop":  # the device runs it still: idle it until the slot is reused
            self.state.done[row.slot] = True
        if n > 1:
            self.stats.tpot.add((now - row.first_s) / (n - 1))
        self.stats.finished(len(row.request.prompt), n, reason)
        self.blocks.give(row.blocks)
        self._reserved -= row.cap - len(row.blocks)
        self.state.host["block_table"][row.slot] = 0
        self._rows[row.slot] = None
        heapq.heappush(self._free, row.slot)
        if self._free_since is None:
            self._free_since = self.stats.decode_steps
        asked = row.logprobs is not None
        text = row.text.cut(row.tokens) if reason == "stop" else None
        emit(Finished(row.request, Completion(
            row.tokens, reason, len(row.request.prompt), n,
            logprobs=row.token_logprobs if asked else None,
            top_ids=row.top_ids if asked else None,
            top_logprobs=row.top_logprobs if asked else None,
            prompt_logprobs=row.prompt_logprobs, text=text, sample=row.request.sample)))

    # -- a whole list at once (tests, benchmarks, validate --load) --------------------------------

    def generate(self, prompts: list[list[int]], record_ids: list | None = None,
                 params: list[RequestParams | None] | None = None) -> list[Completion]:
        """Completions of the prompts, in their order; a prompt of n samples gives n, in
        sample order."""
        ids = list(range(len(prompts))) if record_ids is None else list(record_ids)
        params = params or [None] * len(prompts)
        if len(ids) != len(prompts) or len(params) != len(prompts):
            raise GenerationError(f"generate: {len(prompts)} prompts, {len(ids)} record ids and "
                                  f"{len(params)} parameters: give one of each per prompt")
        source = deque(Request(list(p), i, q, tag=k)
                       for k, (p, i, q) in enumerate(zip(prompts, ids, params)))
        done: list[list[Completion | None]] = [[None] * self.samples_of(q) for q in params]

        def take(n: int, block: bool):
            if not source:
                return None
            return [source.popleft() for _ in range(min(n, len(source)))]

        self.serve(take, lambda f: done[f.request.tag].__setitem__(f.request.sample,
                                                                   f.completion))
        return [c for samples in done for c in samples]

    def graphs(self) -> list[dict]:
        """Per graph set up: kind, shape, status, capture time, memory, verification."""
        return [entry.describe() for entry in self.table.entries.values()]

    def close(self) -> None:
        """Drop the graphs and buffers; a transformers model gets its attention back."""
        self._close_model()
        self.table.close()
        self.cache = self.state = None


def build_engine(model, config: GenerateConfig, *, slots: int, max_prompt: int, device="cpu",
                 dtype=torch.float32, backend: str | None = None, **kwargs) -> Engine:
    """An Engine with the backend its device allows: captured graphs on a GPU, else eager."""
    device = torch.device(device)
    backend = backend or ("cuda-graph" if device.type == "cuda" else "eager")
    return Engine(model, config=config, slots=slots, max_prompt=max_prompt, device=device,
                  dtype=dtype, backend=backend, **kwargs)
