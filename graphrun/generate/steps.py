"""The two steps the engine runs, as closures over static buffers: prefill and decode.

SlotState holds every per-slot buffer, allocated once for the engine's slots (plus one spare row,
the slot padded prefill rows join, which no decode step reads). A decode step of b rows uses the
first b slots (the scheduler fills the lowest free slot first, so the rows in use stay at the
front). Each slot's position, KV length, block table, sampling parameters, stop ids and token
budget are data in these buffers: one decode graph per row count serves every length.

The host writes a slot's fixed values (its block table, parameters, stop ids) when it admits or
grows a row (SlotState.push); the prefill sets its token, length and index; from then on every
per-row value advances on the device inside the decode step, so a decode replay needs no host
copy, and a row that stops stays put (done) until the host hands its slot to another prompt.

A step is `model(tokens, positions, StepKV) -> logits [rows, V] float32`, then the pick, then
the bookkeeping; nothing reads a device value on the host, branches on one or makes a shape
from one, so the same closure runs eagerly (CPU, backend eager) or is captured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch

from graphrun.generate.config import GenerateConfig
from graphrun.models.causal.kv_cache import PagedCache, StepKV
from graphrun.generate import sampling
from graphrun.generate.sampling import penalize, pick, token_logprobs


class StepModel(Protocol):
    """A model the engine can drive: graphrun's Llama or GPT-2, or an adapted transformers LM."""

    vocab: int

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor,
                 kv: StepKV) -> torch.Tensor:
        """tokens, positions: [b, q] int64 -> logits [rows, V] (StepKV.last_hidden), in the
        model's dtype: a step casts them into its float32 buffer, one pass over them."""
        ...


# the per-slot values the host writes (numpy mirrors, pushed whole when changed)
HOST_FIELDS = ("block_table", "keys", "temperature", "top_k", "top_p", "min_p", "repetition",
               "presence", "frequency", "max_new", "stops")
# the values the steps change, and what a verification run restores
STEP_FIELDS = ("token", "seq_lens", "index", "done", "logits", "picked", "counts",
               "prompt_seen", "logprobs", "top_ids", "p_logprobs")
# the device's per-row values that move with a row to another slot (Engine._compact)
ROW_FIELDS = ("token", "seq_lens", "index", "done", "counts", "prompt_seen")


@dataclass(frozen=True)
class Variant:
    """What an engine's steps compute beyond the greedy pick, fixed when they are built (a
    greedy job pays for none of it). sample: some row may sample; filtered: some row may have
    top_k, top_p or min_p on; penalized: some row may have a penalty on (the steps count each
    row's tokens); logprobs: top alternatives per token computed for every row (the most any
    row may ask), None: no log-probabilities."""

    sample: bool = False
    filtered: bool = False
    penalized: bool = False
    logprobs: int | None = None
    prompt_logprobs: bool = False  # the prefill's logits at every prompt token, scored


class SlotState:
    """Static device buffers of the decode slots and of one packed prefill."""

    def __init__(self, slots: int, max_blocks: int, prefill_tokens: int, stop_width: int,
                 config: GenerateConfig, vocab: int, device: torch.device, *,
                 num_blocks: int, block_size: int, variant: Variant = Variant(),
                 prefix_blocks: int = 0):
        self.slots, self.max_blocks, self.prefill_tokens = slots, max_blocks, prefill_tokens
        self.prefix_blocks = prefix_blocks  # cached blocks one prefill reads at most
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device = device
        rows = slots + 1  # the last: where padded prefill rows go
        self.spare = slots
        i64 = dict(dtype=torch.int64, device=device)
        # per slot, advanced by the steps
        self.token = torch.zeros(rows, **i64)  # the token the next decode step feeds
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)  # keys, new included
        self.index = torch.zeros(rows, **i64)  # place in the completion of the next pick
        self.done = torch.ones(rows, dtype=torch.bool, device=device)  # stopped, or empty
        # what the last step picked and its logits: the host's per-step output, verification's
        self.picked = torch.zeros(rows, **i64)
        self.logits = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        # each row's output tokens counted and its prompt's tokens marked, for the penalties
        # ([rows, 0] where no row may be penalized); reset by the prefill that admits the row
        width = vocab if variant.penalized else 0
        self.counts = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self.prompt_seen = torch.zeros(rows, width, dtype=torch.bool, device=device)
        # the last step's log-probabilities: the picked token's, then the top k's [rows, 1 + k],
        # and the top k's ids [rows, k] (k 0 where none are computed)
        top = variant.logprobs or 0
        self.logprobs = torch.zeros(rows, 1 + top, dtype=torch.float32, device=device)
        self.top_ids = torch.zeros(rows, top, **i64)
        # per slot, written by the host
        self.host = {
            "block_table": np.zeros((rows, max_blocks), dtype=np.int32),  # 0: the trash block
            "keys": np.zeros(rows, dtype=np.int64),  # the record's sampling stream
            "temperature": np.zeros(rows, dtype=np.float32),  # 0: greedy
            "top_k": np.zeros(rows, dtype=np.int64),
            "top_p": np.ones(rows, dtype=np.float32),
            "min_p": np.zeros(rows, dtype=np.float32),  # 0: off
            "repetition": np.ones(rows, dtype=np.float32),  # 1: off
            "presence": np.zeros(rows, dtype=np.float32),
            "frequency": np.zeros(rows, dtype=np.float32),
            "max_new": np.ones(rows, dtype=np.int64),
            "stops": np.full((rows, stop_width), -1, dtype=np.int64),  # -1: no id
        }
        for name, values in self.host.items():
            setattr(self, name, torch.from_numpy(values.copy()).to(device))
        # one packed prefill: up to `prefill_tokens` tokens of up to `slots` prompts
        n = slots
        self.p_tokens = torch.zeros(prefill_tokens, **i64)
        self.p_positions = torch.zeros(prefill_tokens, **i64)
        self.p_segment = torch.full((prefill_tokens,), -1, **i64)  # its prompt; -1: padding
        # where each packed prompt starts, then the padding, then the pack's end (its length
        # for every entry left): the flash kernel's cumulative lengths (packed_attention.py)
        self.p_starts = torch.zeros(n + 2, dtype=torch.int32, device=device)
        self.p_slots = torch.zeros(prefill_tokens, **i64)  # flat cache slot; 0: the trash
        self.p_last = torch.zeros(n, **i64)  # each prompt's last token in the pack
        self.p_join = torch.full((n,), self.spare, **i64)  # the slot each prompt joins
        self.p_lens = torch.zeros(n, dtype=torch.int32, device=device)
        # each packed token's logprob of the token after it ([0] where not asked)
        scored = prefill_tokens if variant.prompt_logprobs else 0
        self.p_every = torch.arange(scored, **i64)
        self.p_logprobs = torch.zeros(scored, dtype=torch.float32, device=device)
        # the cached blocks the packed prompts start with (0: none) and their place in a row
        self.p_prefix = torch.zeros(prefix_blocks, **i64)
        self.p_depth = torch.zeros(prefix_blocks, **i64)
        self.vocab_ids = torch.arange(vocab, **i64)
        eos = torch.tensor(config.eos_ids, **i64)
        self.eos_column = torch.zeros(vocab, dtype=torch.bool, device=device)  # [V]
        self.eos_column[eos] = True

    PREFILL = ("p_tokens", "p_positions", "p_segment", "p_starts", "p_slots", "p_last",
               "p_join", "p_lens", "p_prefix", "p_depth")

    def push(self, names=HOST_FIELDS) -> None:
        """The host's values of these fields onto the device, in stream order (a pinned copy
        on a GPU: torch keeps it until the copy has run, so the mirror may change at once)."""
        for name in names:
            source = torch.from_numpy(self.host[name])
            if self.device.type == "cuda":
                source = source.pin_memory()
            getattr(self, name).copy_(source, non_blocking=True)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Every buffer but the cache, for verification to run on and put back."""
        names = STEP_FIELDS + HOST_FIELDS + self.PREFILL
        return {n: getattr(self, n).clone() for n in names}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        for name, t in saved.items():
            getattr(self, name).copy_(t)


def _pick(state: SlotState, config: GenerateConfig, logits: torch.Tensor, rows,
          index: torch.Tensor, variant: Variant) -> torch.Tensor:
    """logits [n, V] of the slots `rows` [n] (or a slice) at completion place `index` [n]:
    the rows' penalties, stop ids masked before min_new_tokens, then each row's own pick; the
    picked tokens' log-probabilities (of the model's logits) into state.logprobs."""
    n = logits.shape[0]
    scores = logits
    if variant.penalized:
        scores = penalize(scores, state.counts[rows], state.prompt_seen[rows],
                          state.repetition[rows], state.presence[rows], state.frequency[rows])
    if config.min_new_tokens and config.eos_ids:
        early = (index < config.min_new_tokens)[:, None] & state.eos_column[None, :]  # [n, V]
        scores = scores.masked_fill(early, float("-inf"))
    token = pick(scores, state.temperature[rows], state.top_k[rows], state.top_p[rows],
                 state.min_p[rows], state.keys[rows], index, state.vocab_ids,
                 sample=variant.sample, filtered=variant.filtered)
    if variant.logprobs is not None:
        values, ids = token_logprobs(logits, token, variant.logprobs)
        state.logprobs[:n].copy_(values)
        state.top_ids[:n].copy_(ids)
    return token


def _prefix_view(state: SlotState, segment: torch.Tensor, width: int) -> dict:
    """StepKV's prefix and prefix_mask over the first `width` cached blocks the host listed:
    a token sees a cached block's keys when its row's block table holds that block at that
    block's depth (a cached block is in no other row's table there but its sharers'; padding,
    segment -1, sees none)."""
    if not width:
        return {}
    blocks, depth = state.p_prefix[:width], state.p_depth[:width]  # [P]
    table = state.block_table[state.p_join[segment.clamp(min=0)]]  # [T, max_blocks]
    held = table.long().gather(1, depth[None].expand(segment.shape[0], -1))  # [T, P]
    sees = (held == blocks[None]) & (blocks != 0)[None] & (segment >= 0)[:, None]
    t, p = sees.shape
    mask = sees[:, :, None].expand(t, p, state.block_size).reshape(t, p * state.block_size)
    return {"prefix": blocks, "prefix_mask": mask[None, None]}


def prefill_step(model: StepModel, state: SlotState, cache: PagedCache, config: GenerateConfig,
                 tokens: int, variant: Variant, prefix: int = 0,
                 unpacked: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> Callable[[], None]:
    """The admitted prompts packed into `tokens` tokens through the model: their keys written
    into their blocks, each prompt's first token picked, and its slot set to decode from
    there (token, length, index, done, and the penalties' counts). prefix: how many cached
    blocks (state.p_prefix) the packed prompts read; a shape, so the captured prefills read
    none and a prefill that reads some runs eagerly (Engine._prefill). unpacked: (slots [m],
    tokens [m]), the prompt tokens of those blocks, marked seen for the penalties as the
    packed ones are."""

    def step() -> None:
        positions = state.p_positions[:tokens]  # [T]
        segment = state.p_segment[:tokens]
        scored = variant.prompt_logprobs  # then every token's logits [T, V], else the last's
        kv = StepKV(cache, segment=segment, positions=positions, starts=state.p_starts,
                    slots=state.p_slots[:tokens],
                    last=state.p_every[:tokens] if scored else state.p_last,
                    **_prefix_view(state, segment, prefix))
        out = model(state.p_tokens[:tokens][None], positions[None], kv)  # [n or T, V]
        if scored:
            out = out.float()
            after = torch.roll(state.p_tokens[:tokens], -1)[:, None]  # [T, 1]: the next token
            state.p_logprobs[:tokens].copy_(out.log_softmax(-1).gather(1, after)[:, 0])
            out = out.index_select(0, state.p_last)  # [n, V]
        join = state.p_join  # [n]
        logits = state.logits[:join.shape[0]]
        logits.copy_(out)  # float32, in the buffer verification reads
        index = torch.zeros_like(join)
        if variant.penalized:  # the joining rows' counts from zero, their prompts marked
            state.counts.index_fill_(0, join, 0)
            state.prompt_seen.index_fill_(0, join, False)
            owner = torch.where(segment >= 0, join[segment.clamp(min=0)], state.spare)  # [T]
            state.prompt_seen.index_put_((owner, state.p_tokens[:tokens]),
                                         torch.ones_like(owner, dtype=torch.bool))
            if unpacked is not None:
                state.prompt_seen.index_put_(unpacked, torch.ones_like(unpacked[0],
                                                                       dtype=torch.bool))
        token = _pick(state, config, logits, join, index, variant)
        if variant.penalized:  # padded prompts count on the spare row, which nothing reads
            state.counts.index_put_((join, token), torch.ones_like(token, dtype=torch.int32),
                                    accumulate=True)
        stop = (token[:, None] == state.stops[join]).any(dim=-1) | (state.max_new[join] <= 1)
        state.picked[:join.shape[0]].copy_(token)
        # padded prompts all join the spare slot: whichever lands there is never read
        state.token.index_copy_(0, join, token)
        state.seq_lens.index_copy_(0, join, state.p_lens + 1)
        state.index.index_copy_(0, join, index + 1)
        state.done.index_copy_(0, join, stop)

    return step


def decode_step(model: StepModel, state: SlotState, cache: PagedCache, config: GenerateConfig,
                rows: int, variant: Variant) -> Callable[[], None]:
    """One token for each of the first `rows` slots: the last token at the row's own position,
    attending over its own keys through its block table. A stopped or empty slot picks the pad
    id and stays where it is."""

    def step() -> None:
        seq = state.seq_lens[:rows]  # [b] int32
        kv = StepKV(cache, block_table=state.block_table[:rows], seq_lens=seq)
        logits = state.logits[:rows]  # [b, V] float32, the buffer verification reads
        logits.copy_(model(state.token[:rows, None], (seq.long() - 1)[:, None], kv))
        index, done = state.index[:rows], state.done[:rows]
        token = _pick(state, config, logits, slice(0, rows), index, variant)
        if variant.penalized:  # a live row's pick counted (a stopped row's adds 0)
            state.counts[:rows].scatter_add_(1, token[:, None], (~done).int()[:, None])
        advance(state, token, rows, config.pad_id)

    return step


ADVANCE_ROWS = 64  # rows one program of the bookkeeping's kernel takes


def advance(state: SlotState, picked: torch.Tensor, rows: int, pad_id: int) -> None:
    """A decode step's bookkeeping after its pick (picked [rows] int64) for the first `rows`
    slots: a stopped or empty slot's pick becomes pad_id; a live row moves on a place and a key
    and stops at one of its stop ids or its max_new; token and picked get the pick. One
    kernel where the pick's kernels run (generate/pick_kernels.advance), else torch's ops."""
    if not torch.compiler.is_compiling() and sampling.SWITCH.on(state.device):
        try:
            width = state.stops.shape[1]
            sampling.SWITCH.kernels.advance[(-(-rows // ADVANCE_ROWS),)](
                picked, state.done, state.stops, state.index, state.max_new, state.seq_lens,
                state.token, state.picked, pad_id, rows, state.stops.stride(0), width,
                R=ADVANCE_ROWS, BS=max(2, 1 << (width - 1).bit_length()), num_warps=4)
            return
        except Exception as err:  # noqa: BLE001 - a kernel that cannot run: torch's ops
            sampling.give_up(err)
    advance_eager(state, picked, rows, pad_id)


_advance_checked: dict[str, bool] = {}  # device -> the bookkeeping's kernel agreed


def check_kernels(device: torch.device, vocab: int) -> list[str]:
    """The pick's kernels (sampling.check_kernel) and then the bookkeeping's (advance) against
    torch's ops on `device`, once per device: one that differs or cannot run is given up with
    the others (they share a switch), and torch's ops run. What ran by the kernels, for the
    warm-up's report."""
    ran = sampling.check_kernel(device, vocab)
    if ran and str(device) not in _advance_checked:
        _advance_checked[str(device)] = _check_advance(torch.device(device))
    return ran if not sampling.SWITCH.failures else []


def _check_advance(device: torch.device) -> bool:
    """advance's kernel against advance_eager on one seeded state (advance_differs)."""
    wrong = advance_differs(device, slots=80, rows=70, width=3)
    if sampling.SWITCH.failures:  # the kernel could not run (advance gave it up)
        return False
    if wrong:
        sampling.give_up(RuntimeError(f"the bookkeeping kernel differs from torch's ops on "
                                      f"{device} in {', '.join(wrong)}"))
    return not wrong


def advance_differs(device: torch.device, slots: int, rows: int, width: int) -> list[str]:
    """The fields (done, index, seq_lens, token, picked) in which advance leaves a seeded state
    of `slots` slots other than advance_eager does, stepping its first `rows`: stopped and
    live rows, picks at one of `width` stop ids, rows at their max_new, slots past the rows
    that must stay as they were."""
    picked = torch.randint(0, 6, (rows,), generator=torch.Generator().manual_seed(0))

    def state() -> SlotState:
        g = torch.Generator().manual_seed(slots)
        s = SlotState.__new__(SlotState)  # the fields advance reads, no engine's buffers
        s.device = device
        s.done = (torch.rand(slots, generator=g) < 0.3).to(device)
        s.stops = torch.randint(-1, 6, (slots, width), generator=g).to(device)
        s.index = torch.randint(0, 9, (slots,), generator=g).to(device)
        s.max_new = torch.randint(1, 10, (slots,), generator=g).to(device)
        s.seq_lens = torch.randint(1, 99, (slots,), generator=g).int().to(device)
        s.token = torch.randint(0, 9, (slots,), generator=g).to(device)
        s.picked = torch.randint(0, 9, (slots,), generator=g).to(device)
        return s

    got, want = state(), state()
    advance(got, picked.to(device), rows, 7)
    advance_eager(want, picked.to(device), rows, 7)
    return [n for n in ("done", "index", "seq_lens", "token", "picked")
            if not torch.equal(getattr(got, n), getattr(want, n))]


def advance_eager(state: SlotState, picked: torch.Tensor, rows: int, pad_id: int) -> None:
    """advance in torch's ops."""
    done, index, seq = state.done[:rows], state.index[:rows], state.seq_lens[:rows]
    token = torch.where(done, pad_id, picked)
    live = ~done
    stop = (token[:, None] == state.stops[:rows]).any(dim=-1)
    index += live.long()
    done |= live & (stop | (index >= state.max_new[:rows]))
    seq += live.int()
    state.token[:rows].copy_(token)
    state.picked[:rows].copy_(token)
