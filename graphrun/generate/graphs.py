"""The generation engine's graph table: one entry per (kind, size), all set up before the first
prompt.

kind "decode" has size = rows (slots stepped at once), kind "prefill" size = tokens (the admitted
prompts packed into one sequence); no length appears in a key. The mechanics every graph of a
job shares (side-stream warm-up, capture into one pool, the memory budget, a graph set aside for
eager) are engine/graphs.py's GraphPool, as for a forward pass; what is generation's own is here:
its steps run on the slot state, so set-up snapshots and restores it, and its verification
compares picked tokens and logits with the near-tie rule (compare_runs). A capture that fails, a
graph that disagrees with eager, or one that takes the graphs past the memory budget runs
eagerly instead, with the reason recorded: the tokens stay right, only slower. With backend
eager an entry is the step itself.

With model.compile an entry's step runs the compiled step model (generate/compiled.py), checked
against the plain model's eager steps. Where the compiler fails, its step cannot be captured or
it disagrees with the plain model, the entry is set up from the plain model instead, with the
reason; after a failed compilation every later entry is too.

Verification runs a few steps eagerly (these runs are also the warm-up), restores the per-row
state, captures, and replays the same steps: every key read was either there before (the same
for both) or written by this run's earlier steps, so the cache itself needs no copy. It runs
before the first prompt is admitted, so the blocks it writes hold nobody's keys.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from graphrun.engine.graphs import Graph, GraphPool, SetUp
from graphrun.engine.verify import ULP_SLACK, compare
from graphrun.base.errors import CaptureError, first_line

from graphrun.models.causal import fused, packed_attention, paged_attention
from graphrun.generate import sampling
from graphrun.generate.steps import SlotState

VERIFY_STEPS = 2  # decode steps compared per bucket: the second reads what the first wrote
# eager runs of a step before its capture, the verification's own included: the first loads or
# compiles every kernel and makes cuBLAS's workspace on the side stream, and no step autotunes,
# so a prefill's one verified run is its warm-up as a decode's two are
WARM_UP_RUNS = 1
COMPILED_WARM_UP_RUNS = 2  # a compiled step's: the second runs what the first compiled
# the share of rows whose picked tokens may differ from eager's when the logits are close:
# a near tie may flip under half precision, never in float32
TOKEN_SLACK = {torch.float32: 0.0, torch.float64: 0.0}
HALF_TOKEN_SLACK = 0.1
# a compiled step against the plain model, half precision: the largest logit error allowed,
# as a share of the largest logit (inductor keeps float32 where eager rounds every op)
COMPILED_HALF_SHARE = 0.05


@dataclass(frozen=True)
class StepKey:
    kind: str  # "prefill" | "decode"
    size: int  # decode: rows; prefill: tokens

    @property
    def axis(self) -> str:
        return "tokens" if self.kind == "prefill" else "rows"

    @property
    def name(self) -> str:
        return f"{self.axis}={self.size}"


@dataclass(kw_only=True)
class StepGraph(Graph, SetUp):
    """A step of the table (engine/graphs.Graph) and how its set-up went (engine/graphs.SetUp),
    for the manifest."""

    key: StepKey
    status: str = "eager"  # captured | eager
    set_up: str = "setup"  # setup | first_use
    set_up_s: float | None = None  # warm-up, capture and verification
    verify: dict = field(default_factory=dict)  # passed, max_error, token_mismatches, steps
    compiled: bool | None = None  # model.compile: its kernels ran (False: fell back); None: off
    plain: Callable[[], None] | None = None  # the step on the plain model, while compiled

    def describe(self) -> dict:
        shape = {self.key.axis: self.key.size}
        return {"kind": self.key.kind, "shape": shape, "axis": self.key.axis,
                "status": self.status,
                "reason": self.reason, "set_up": self.set_up, "set_up_s": self.set_up_s,
                "capture_s": self.capture_s,
                "memory_bytes": self.memory_bytes, "compiled": self.compiled,
                "verify_max_error": self.verify.get("max_error"), "verify": dict(self.verify)}


class GraphTable:
    """Entries by StepKey; make_step(key, compiled) builds a step closure over the static
    buffers, on the compiled step model (model.compile) or the plain one. pool: a memory pool
    handle to capture into, else a new one."""

    def __init__(self, make_step: Callable[[StepKey, bool], Callable[[], None]],
                 state: SlotState, *, backend: str, device: torch.device, dtype: torch.dtype,
                 pool, verify: bool, budget_bytes: int | None, log: Callable[[str], None],
                 compiled: bool = False):
        self.make_step, self.state, self.log = make_step, state, log
        self.compiling = compiled  # off for good after a compilation fails
        self.compile_failure: str | None = None  # the reason, given to every later entry
        self.kernel_failures: list[str] = []  # a Triton kernel that failed, each noted once
        self.graphs = backend == "cuda-graph"
        self.device, self.dtype, self.verify_on = device, dtype, verify
        self.pool = GraphPool(device, graphs=self.graphs, pool=pool, budget_bytes=budget_bytes)
        self.entries: dict[StepKey, StepGraph] = {}

    def prepare(self, keys: list[StepKey], how: str) -> None:
        """Set up the keys not set up yet, largest first (prefill before decode, then by rows
        and length): the smaller graphs reuse the blocks the larger ones left in the pool."""
        todo = sorted({k for k in keys if k not in self.entries},
                      key=lambda k: (k.kind == "prefill", k.size), reverse=True)
        for key in todo:
            self.entries[key] = entry = self._set_up(key, how)
            self._note_kernel_failures(entry)

    def _note_kernel_failures(self, entry: StepGraph) -> None:
        """A kernel that failed in this entry's set-up (the paged decode attention's, the
        prefill's flash attention, the fused elementwise ones' or the pick's): said once, a
        warning and that graph's reason."""
        for what, failed in (("the decode attention kernel failed, the general path runs",
                              paged_attention.failure()),
                             ("the prefill's flash attention failed, the masked one runs",
                              packed_attention.failure()),
                             ("the fused elementwise kernels failed, torch's ops run",
                              fused.failure()),
                             ("the pick's kernel failed, torch's ops run",
                              sampling.kernel_failure())):
            note = f"{what}: {failed}"
            if failed and note not in self.kernel_failures:
                self.kernel_failures.append(note)
                entry.reason = "; ".join(filter(None, (entry.reason, note)))
                self.log(f"warning: {note}")

    def __getitem__(self, key: StepKey) -> StepGraph:
        return self.entries[key]

    def close(self) -> None:
        self.entries.clear()
        self.pool.close()

    def _set_up(self, key: StepKey, how: str) -> StepGraph:
        entry = StepGraph(self.make_step(key, self.compiling), key=key, set_up=how)
        if not self.graphs:
            entry.reason = self.pool.eager_reason
        if self.compiling:
            entry.compiled, entry.plain = True, self.make_step(key, False)
        elif self.compile_failure:
            entry.compiled = False
            entry.reason = "; ".join(filter(None, (entry.reason, self.compile_failure)))
        if not self.graphs:
            if entry.compiled:  # compiled now, on a batch the step can take, not mid-stream
                t0 = time.perf_counter()
                saved = self.state.snapshot()
                with torch.no_grad():
                    fill_synthetic(self.state, key)
                    self._run_compiled(entry)
                self.state.restore(saved)
                entry.set_up_s = time.perf_counter() - t0
            return entry
        t0 = time.perf_counter()
        saved = self.state.snapshot()
        with torch.no_grad():
            fill_synthetic(self.state, key)  # warm-up on values the step can take
            start = self.state.snapshot()
            # the eager reference is the warm-up: an eager step costs far more than a replay
            want, plain = self._warm_up(entry, start)
            self.state.restore(start)
            self._capture(entry)
            if not entry.compiled:  # never compiled, or fell back: the plain model's runs
                want = plain
            if entry.graph is not None and want is not None:
                self._verify(entry, start, want)
        self.state.restore(saved)
        entry.set_up_s = time.perf_counter() - t0
        return entry

    def _warm_up(self, entry: StepGraph, start: dict[str, torch.Tensor]):
        """WARM_UP_RUNS eager runs on the side stream (COMPILED_WARM_UP_RUNS of a compiled
        step); when verifying, the first ones are the reference steps, run from `start`.
        Returns (the compiled step's eager runs, the plain model's): a compiled capture replays
        the compiled kernels, so they are its reference, once they agree with the plain
        model's (None when not verifying)."""
        steps = verify_steps(entry.key) if self.verify_on else 0
        want = plain = None
        with self.pool.side_stream():
            if steps:
                plain = run_checked(entry, self.state, steps, replay=False,
                                    step=entry.plain if entry.compiled else None)
            if entry.compiled:
                self.state.restore(start)
                want = self._compiled_reference(entry, steps, plain)
            runs = (COMPILED_WARM_UP_RUNS - 1 if entry.compiled else WARM_UP_RUNS) - steps
            for _ in range(max(0, runs)):
                self.state.restore(start)
                entry.step()
        return want, plain

    def _compiled_reference(self, entry: StepGraph, steps: int, plain):
        """The compiled step's first runs (the first compiles), checked against the plain
        model's `plain` runs: its picks agree (float32: its logits too), else the entry falls
        back to the plain model. Returns the reference its capture is verified against."""
        try:
            got = run_checked(entry, self.state, max(1, steps), replay=False)
        except Exception as err:  # noqa: BLE001 - any compiler failure: the plain step runs
            self._compile_failed(entry, err)
            return plain
        if plain is None:
            return None
        check = compare_runs(got, plain, self.dtype, len(plain[0][0]), compiled=True)
        entry.verify["compiled_vs_plain"] = check
        if not check["passed"]:
            self._uncompile(entry, (
                f"the compiled step disagrees with the plain model (max logit error "
                f"{check['max_error']:.3g}, {check['token_mismatches']} rows picked other "
                "tokens): captured without model.compile"))
            return plain
        return got

    def _run_compiled(self, entry: StepGraph) -> None:
        """One run of a compiled step (the first compiles); the eager backend's set-up."""
        try:
            entry.step()
        except Exception as err:  # noqa: BLE001 - any compiler failure: the plain step runs
            self._compile_failed(entry, err)
            entry.step()

    def _compile_failed(self, entry: StepGraph, err: BaseException) -> None:
        """This entry, and every later one, on the plain model."""
        self.compiling = False
        self.compile_failure = f"model.compile failed, runs without it: {first_line(err)}"
        self._uncompile(entry, self.compile_failure)

    def _uncompile(self, entry: StepGraph, reason: str) -> None:
        """The entry on the plain model's step (before any graph of it is captured)."""
        entry.step, entry.plain, entry.compiled = entry.plain, None, False
        entry.to_eager()  # its run: the plain step
        entry.reason = "; ".join(filter(None, (entry.reason, reason)))
        self.log(f"warning: {entry.key.kind} {entry.key.name}: {reason}")

    def _capture(self, entry: StepGraph) -> None:
        try:
            graph, entry.capture_s, entry.memory_bytes = self.pool.capture(
                entry.step, entry.key.name, first_use=entry.set_up == "first_use")
        except CaptureError as err:
            if entry.compiled:  # the plain step may capture where the compiled one did not
                self._uncompile(entry, f"the compiled step could not be captured ({err}): "
                                       "captured without model.compile")
                return self._capture(entry)
            return self._eager(entry, f"capture failed, runs eagerly: {err}")
        entry.use(graph)
        past = self.pool.past_budget()
        if past:
            return self._eager(entry, f"its graph {past}: runs eagerly")
        entry.status = "captured"
        self.log(f"captured {entry.key.kind} {entry.key.name} in "
                 f"{entry.capture_s * 1e3:.1f} ms")

    def _verify(self, entry: StepGraph, start: dict[str, torch.Tensor],
                want: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
        self.state.restore(start)
        result = verify_entry(entry, self.state, self.dtype, want)
        entry.verify = {**entry.verify, **result}  # beside compiled_vs_plain, if any
        if not result["passed"]:
            self._eager(entry, f"verification failed (max logit error {result['max_error']:.3g}, "
                               f"{result['token_mismatches']} rows picked other tokens): runs "
                               "eagerly")

    def _eager(self, entry: StepGraph, reason: str) -> None:
        """The entry's step runs eagerly from now on (its graph set aside), with the reason."""
        self.pool.fall_back(entry, [entry], reason)
        self.log(f"warning: {entry.key.kind} {entry.key.name}: {reason}")


def _near_ties(got_t: torch.Tensor, want_t: torch.Tensor, want: torch.Tensor,
               gap: float) -> torch.Tensor:
    """Rows picking another token whose plain logit is within `gap` of the plain pick's."""
    rows = torch.arange(want.shape[0], device=want.device)
    other = got_t != want_t
    return (other & (want[rows, want_t] - want[rows, got_t] <= gap)).sum()


def verify_steps(key: StepKey) -> int:
    return 1 if key.kind == "prefill" else VERIFY_STEPS


def fill_synthetic(state: SlotState, key: StepKey, seed: int = 1234) -> None:
    """A seeded input the step can run, every row live: prefill, a few prompts packed (their
    keys written to the trash block, no cached prefix read); decode, each row a short
    length in a block of its own where the pool has enough (blocks 1.., holding nobody's keys
    yet), sampling as the spec's defaults are."""
    gen = torch.Generator().manual_seed(seed + key.size * 7919 + (key.kind == "prefill"))
    vocab = state.vocab_ids.numel()
    dev = state.device
    n = key.size

    def ints(low: int, high: int, count: int) -> torch.Tensor:
        return torch.randint(low, max(low + 1, high), (count,), generator=gen).to(dev)

    state.keys.copy_(ints(-2**62, 2**62, state.keys.numel()))
    if key.kind == "prefill":
        prompts = min(state.p_join.numel(), max(1, n // 8))
        cut = torch.linspace(0, n, prompts + 1).long()  # prompt i: tokens cut[i]..cut[i+1]
        lens = (cut[1:] - cut[:-1]).clamp_min(1)
        segment = torch.repeat_interleave(torch.arange(prompts), lens)[:n]
        starts = cut[:-1]
        state.p_tokens[:n].copy_(ints(0, vocab, n))
        state.p_segment[:n].copy_(segment.to(dev))
        state.p_positions[:n].copy_((torch.arange(n) - starts[segment]).to(dev))
        state.p_starts.fill_(n)  # no padding: the prompts' starts, then n
        state.p_starts[:prompts].copy_(starts.to(dev, torch.int32))
        state.p_slots[:n].zero_()
        state.p_prefix.zero_()
        state.p_last.zero_()
        state.p_last[:prompts].copy_((cut[1:] - 1).clamp_min(0).to(dev))
        state.p_join.fill_(state.spare)
        state.p_join[:prompts].copy_(torch.arange(prompts).to(dev))
        state.p_lens.fill_(1)
        state.p_lens[:prompts].copy_(lens.to(dev, torch.int32))
        state.max_new.fill_(1 << 30)
        return
    blocks = state.block_table.new_zeros(state.block_table.shape)
    room = max(1, state.num_blocks - 1)
    blocks[:n, 0] = 1 + torch.arange(n, device=dev) % room
    state.block_table.copy_(blocks)
    block_size = state.block_size
    state.seq_lens[:n].copy_(ints(1, max(2, block_size - VERIFY_STEPS), n).to(torch.int32))
    state.token[:n].copy_(ints(0, vocab, n))
    state.index[:n].fill_(1)
    state.done[:n].fill_(False)
    state.max_new.fill_(1 << 30)


def run_checked(entry: StepGraph, state: SlotState, steps: int, *, replay: bool,
                step: Callable[[], None] | None = None
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`steps` runs of the entry (replayed, or an eager step: its own unless `step` is
    given): tokens and logits of each."""
    b = entry.key.size if entry.key.kind == "decode" else state.p_join.numel()
    step = step or entry.step
    tokens, logits = [], []
    for _ in range(steps):
        entry.graph.replay() if replay else step()
        tokens.append(state.picked[:b].clone())
        logits.append(state.logits[:b].clone())
    return tokens, logits


def verify_entry(entry: StepGraph, state: SlotState, dtype: torch.dtype,
                 want: tuple[list[torch.Tensor], list[torch.Tensor]]) -> dict:
    """Replay from the state the eager reference `want` (tokens, logits per step) started
    from, and compare (compare_runs)."""
    got = run_checked(entry, state, len(want[0]), replay=True)
    torch.cuda.synchronize(state.device)
    return compare_runs(got, want, dtype, len(want[0][0]))


def compare_runs(got: tuple[list[torch.Tensor], list[torch.Tensor]],
                 want: tuple[list[torch.Tensor], list[torch.Tensor]], dtype: torch.dtype,
                 rows: int, *, compiled: bool = False) -> dict:
    """Picked tokens equal, logits within tolerance (float32: tight; half precision: a few
    units of its precision). compiled: a compiled step against the plain model, whose kernels
    round in another order: float32 logits within 1e-3; half precision's within
    COMPILED_HALF_SHARE of their largest, and another pick only where the plain model's logits
    of the two tokens lie within twice that error (a near tie), so it counts as no mismatch."""
    want_tokens, want_logits = want
    got_tokens, got_logits = got
    steps = len(want_tokens)
    half = dtype not in TOKEN_SLACK
    rtol, atol = (2e-2, 2e-2) if half else (1e-3, 1e-3) if compiled else (1e-4, 1e-4)
    close, worst, mismatches = True, 0.0, 0
    fed_alike = torch.ones_like(want_tokens[0], dtype=torch.bool)  # [b]: same tokens so far
    for got, want, got_t, want_t in zip(got_logits, want_logits, got_tokens, want_tokens):
        # a row that picked another token (a near tie, in half precision) is fed another
        # input from then on: its later logits say nothing about the graph
        got, want = got[fed_alike], want[fed_alike]
        finite = want.isfinite()
        # half precision: kernels picked under capture may round a unit apart (engine/verify)
        slack = ULP_SLACK * torch.finfo(dtype).eps * float(
            want[finite].abs().max()) if half and finite.any() else 0.0
        ok, max_abs, _ = compare(got[finite], want[finite], rtol, atol + slack)
        if half and compiled:  # logits within a share of their range, picks near ties
            bound = COMPILED_HALF_SHARE * float(want[finite].abs().max()) if finite.any() else 0
            ok = bool((got.isfinite() == finite).all()) and max_abs <= bound
            mismatches -= int(_near_ties(got_t[fed_alike], want_t[fed_alike], want,
                                         2 * max_abs))
        close, worst = close and ok, max(worst, max_abs)
        # a row's first other pick counts, not the later ones its other input leads to
        mismatches += int((fed_alike & (got_t != want_t)).sum())
        fed_alike &= got_t == want_t
    allowed = TOKEN_SLACK.get(dtype, HALF_TOKEN_SLACK) * rows * steps
    return {"passed": close and mismatches <= allowed, "max_error": worst,
            "token_mismatches": mismatches, "steps": steps}
