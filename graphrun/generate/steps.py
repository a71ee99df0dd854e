"""The two steps a batch runs, as closures over static buffers: prefill and decode.

RowState holds every per-row buffer, allocated once at the largest batch bucket; a step of b
rows uses the first b (rows lead every shape, so `[:b]` is contiguous and shared by all
buckets). The host fills the prompt, starts, record keys and real-row flags before prefill;
from then on every per-row value (last token, write column, completion index, done flag, the
completion itself) advances on the device inside the step, so a decode replay needs no host
copy at all, and a batch may switch to a longer KV bucket between any two steps.

A step is `model(tokens, positions, StepKV) -> logits [b, V] float32`, then the pick, then
the bookkeeping; nothing reads a device value on the host, branches on one or makes a shape
from one, so the same closure runs eagerly (CPU, backend eager) or is captured.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, Protocol

import torch

from graphrun.generate.config import GenerateConfig
from graphrun.generate.kv_cache import KVCache, StepKV
from graphrun.generate.sampling import pick


class StepModel(Protocol):
    """A model the generator can drive: the builtin llama, or an adapted transformers LM."""

    vocab: int

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor,
                 kv: StepKV) -> torch.Tensor:
        """tokens, positions: [b, q_len] int64 -> logits of the last column [b, V] float32."""
        ...


class RowState:
    """Per-row static device buffers (continuous batching would refill one row's values)."""

    def __init__(self, rows: int, max_prompt: int, config: GenerateConfig, vocab: int,
                 max_len: int, device: torch.device):
        i64 = dict(dtype=torch.int64, device=device)
        self.rows, self.max_prompt = rows, max_prompt
        self.prompt_flat = torch.zeros(rows * max_prompt, **i64)  # viewed [b, P] per bucket
        self.start = torch.zeros(rows, **i64)  # the row's first real column (left padding)
        self.real = torch.zeros(rows, dtype=torch.bool, device=device)  # a record, not padding
        self.keys = torch.zeros(rows, **i64)  # the record's sampling stream (sampling.py)
        self.token = torch.zeros(rows, **i64)  # the last token, fed to the next decode step
        self.col = torch.zeros(rows, **i64)  # the cache column the next decode step writes
        self.index = torch.zeros(rows, **i64)  # place in the completion of the next token
        self.done = torch.ones(rows, dtype=torch.bool, device=device)
        self.out = torch.zeros(rows, config.max_new_tokens, **i64)  # the completions
        self.logits = torch.zeros(rows, vocab, dtype=torch.float32, device=device)  # last step's
        self.all_done = torch.ones(1, dtype=torch.bool, device=device)
        self.columns = torch.arange(max_len, **i64)  # key columns, for masks and positions
        self.vocab_ids = torch.arange(vocab, **i64)
        self.eos = torch.tensor(config.eos_ids, **i64)  # [E]
        self.eos_column = torch.zeros(vocab, dtype=torch.bool, device=device)  # [V]
        self.eos_column[self.eos] = True

    def prompt(self, b: int, p: int) -> torch.Tensor:
        return self.prompt_flat[: b * p].view(b, p)  # [b, P], contiguous

    SMALL = ("start", "real", "keys", "token", "col", "index", "done", "out", "logits",
             "all_done")

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The small per-row buffers (not the prompt, not the cache), for verification."""
        return {n: getattr(self, n).clone() for n in self.SMALL}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        for name, t in saved.items():
            getattr(self, name).copy_(t)


def _next_token(state: RowState, config: GenerateConfig, logits: torch.Tensor,
                b: int) -> torch.Tensor:
    """logits [b, V] float32 -> the next token [b]: EOS masked before min_new_tokens, then the
    pick; a row already done gets the pad id. The logits are kept for verification."""
    index = state.index[:b]
    if config.min_new_tokens and config.eos_ids:
        early = (index < config.min_new_tokens)[:, None] & state.eos_column[None, :]  # [b, V]
        logits = logits.masked_fill(early, float("-inf"))
    state.logits[:b].copy_(logits)
    token = pick(logits, config.sampling, state.keys[:b], index, state.vocab_ids)
    return torch.where(state.done[:b], config.pad_id, token)


def _record(state: RowState, token: torch.Tensor, b: int) -> None:
    """token [b] becomes each row's completion entry at its index, and the next input."""
    index = state.index[:b]
    # clamped: a verification step past the last place (its state is restored after) writes
    # the last entry instead of out of bounds; a batch's own steps never get there
    last = state.out.shape[1] - 1
    state.out[:b].scatter_(1, index.clamp(max=last)[:, None], token[:, None])
    is_eos = (token[:, None] == state.eos[None, :]).any(dim=-1)  # [b]; False when no eos ids
    state.done[:b] |= is_eos
    state.token[:b].copy_(token)
    index += 1
    state.all_done.copy_(state.done[:b].all().view(1))


def prefill_step(model: StepModel, state: RowState, cache: KVCache, config: GenerateConfig,
                 b: int, p: int) -> Callable[[], None]:
    """The prompt of every row, left-padded to p, through the model: cache columns [0, p)
    written, the first token picked; the rows then wait at column p for decode."""

    def step() -> None:
        tokens = state.prompt(b, p)  # [b, P]
        start = state.start[:b, None]  # [b, 1]
        cols = state.columns[:p]  # [P]
        # positions as transformers' generate makes them: the masked cumsum less one, pads 0
        positions = (cols[None, :] - start).clamp_min(0)  # [b, P]
        visible = cols[None, None, :] >= start[:, :, None]  # [b, 1, P]: keys of the prompt
        causal = cols[None, :] <= cols[:, None]  # [P, P]: key column <= query column
        # each query also sees itself, so a padding query keeps one key (no NaN softmax)
        mask = (causal[None] & visible) | (cols[None, :] == cols[:, None])[None]
        kv = StepKV(cache, b, p, mask[:, None], None)  # mask: [b, 1, P, P]
        logits = model(tokens, positions, kv)
        state.index[:b].zero_()
        state.done[:b].copy_(~state.real[:b])  # padded rows are done from the start
        token = _next_token(state, config, logits, b)
        state.col[:b].fill_(p)
        _record(state, token, b)

    return step


def decode_step(model: StepModel, state: RowState, cache: KVCache, config: GenerateConfig,
                b: int, length: int) -> Callable[[], None]:
    """One token per row: the last token at the row's column, attending over [start, column]
    of the first `length` columns; the column and index move on by one."""

    def step() -> None:
        col, start = state.col[:b], state.start[:b]
        positions = (col - start)[:, None]  # [b, 1]
        cols = state.columns[:length]  # [L]
        visible = (cols[None, :] >= start[:, None]) & (cols[None, :] <= col[:, None])  # [b, L]
        kv = StepKV(cache, b, length, visible[:, None, None, :], col)  # mask: [b, 1, 1, L]
        logits = model(state.token[:b, None], positions, kv)
        token = _next_token(state, config, logits, b)
        _record(state, token, b)
        col += 1

    return step


def kv_lengths(prompt_buckets: list[int], max_new_tokens: int, max_len: int,
               align: int = 16) -> list[int]:
    """The decode graphs' KV lengths: from every prompt bucket a quarter, half, three
    quarters and all of max_new_tokens on (rounded up to `align`, at most max_len), so a short
    prompt's early steps attend over a short cache, not over max_len columns."""
    lengths = set()
    for p in prompt_buckets:
        for quarter in (1, 2, 3, 4):
            reach = p + math.ceil(max_new_tokens * quarter / 4)
            lengths.add(min(max_len, -(-reach // align) * align))
    return sorted(lengths)


def decode_lengths(kv: list[int], prompt: int, max_new_tokens: int) -> list[int]:
    """The KV lengths (of `kv`, sorted) a batch on prompt bucket `prompt` decodes over: step t
    writes column prompt + t - 1, so it runs on the smallest length holding prompt + t."""
    return sorted({kv[bisect.bisect_left(kv, prompt + t)] for t in range(1, max_new_tokens)})
