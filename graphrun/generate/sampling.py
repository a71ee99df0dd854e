"""Picking the next token inside the captured step: repetition, presence and frequency
penalties, greedy, temperature, min-p, top-k, top-p, with a counter-based random draw; and the
log-probabilities of what was picked.

The draw is Gumbel-max: argmax(scores + g), g = -log(-log(u)), where u for (row, token) is a
hash of the row's record key (seed and record id, hashed on the host), the index of the token
in the completion and the token id. No generator state, no torch.multinomial (which syncs and
whose stream follows the batch layout): a record's draws are the same in any row, batch size,
bucket, process or GPU, which makes a seeded completion reproducible under resume and --gpus.
Everything here is elementwise, sort or argmax over static shapes: safe inside a CUDA graph.
"""

from __future__ import annotations

import hashlib

import torch
from torch.nn import functional as F


# splitmix64's constants as int64 (the ones above 2**63 by their negative equivalents)
GOLDEN = 0x9E3779B97F4A7C15 - 2**64
MIX1 = 0xBF58476D1CE4E5B9 - 2**64
MIX2 = 0x94D049BB133111EB - 2**64
STEP = 0xD1B54A32D192ED03 - 2**64  # odd: separates the completion index from the token id


def record_key(seed: int, record_id, sample: int = 0) -> int:
    """The int64 key of a record's random stream: its seed, id (an int or a str, told apart)
    and sample index (of its n), hashed so that neighbouring ids give unrelated streams; sample
    0 hashes as a record of one sample does."""
    text = f"{seed}/{type(record_id).__name__}/{record_id}" + (f"#{sample}" if sample else "")
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little",
                          signed=True)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> on int64 is arithmetic)."""
    return torch.bitwise_right_shift(z, bits).bitwise_and_((1 << (64 - bits)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors: int64 multiplies wrap as uint64's do."""
    z = (z ^ _shift_right(z, 30)) * MIX1
    z = (z ^ _shift_right(z, 27)) * MIX2
    return z ^ _shift_right(z, 31)


def uniforms(keys: torch.Tensor, index: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """u in (0, 1), float32: keys [b] int64, index [b] int64 (token's place in the
    completion), vocab_ids [V] int64 -> [b, V]."""
    row = mix64(keys + index * STEP)  # [b]: the stream of this (record, place)
    z = mix64(row[:, None] + (vocab_ids[None, :] + 1) * GOLDEN)  # [b, V]
    top24 = _shift_right(z, 40).to(torch.float32)  # exact in float32
    return (top24 + 0.5) * (1.0 / (1 << 24))


def gumbel(keys: torch.Tensor, index: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [b, V], float32."""
    return -torch.log(-torch.log(uniforms(keys, index, vocab_ids)))


def penalize(logits: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor,
             repetition: torch.Tensor, presence: torch.Tensor,
             frequency: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties on logits [b, V] float32: a token in the row's prompt or output
    (prompt_seen [b, V] bool, counts [b, V] int32: the row's output tokens) has its logit
    divided by the repetition penalty [b] where positive, multiplied where not; then each
    output token's logit loses frequency [b] times its count and presence [b] once (1, 0, 0:
    off)."""
    present = counts > 0
    rep = torch.where(prompt_seen | present, repetition[:, None], 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    return (logits - frequency[:, None] * counts.to(logits.dtype)
            - presence[:, None] * present.to(logits.dtype))


def filter_scores(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """scores [b, V] float32 (logits already divided by the temperature) -> -inf where a
    token's probability is below its row's min_p [b] float32 (0: off) times the row's most
    likely's, outside each row's top k (top_k [b] int64, 0: off) and outside the smallest set
    whose probability reaches its top_p (top_p [b] float32, 1: off; at least one token kept),
    in vLLM's order (temperature, min-p, top-k, top-p). One sort serves top-k and top-p."""
    vocab = scores.shape[-1]
    # p >= min_p * p_max, in log space: no softmax; log(0) = -inf keeps every token
    floor = scores.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
    scores = scores.masked_fill(scores < floor, float("-inf"))
    ordered, order = torch.sort(scores, dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)  # [b]
    kth = ordered.gather(1, (k - 1)[:, None])  # [b, 1]
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each
    # the first token has 0 before it: always kept; top_p 1 keeps all (a cumsum may pass 1)
    drop = (before > top_p[:, None]) & (top_p < 1.0)[:, None]
    return scores.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))


def token_logprobs(logits: torch.Tensor, token: torch.Tensor,
                   top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own log-probabilities (log_softmax of its logits [b, V], before penalties,
    temperature and filters, as OpenAI and vLLM report them): [b, 1 + top] float32 (the
    picked token's [b] int64, then the `top` most likely, best first) and their ids [b, top]."""
    lp = logits.log_softmax(dim=-1)
    picked = lp.gather(1, token[:, None])
    if not top:
        return picked, token.new_zeros((token.shape[0], 0))
    best, ids = lp.topk(top, dim=-1)
    return torch.cat([picked, best], dim=1), ids


SPLIT_ARGMAX = 16384  # from this vocabulary size on, the argmax runs in two stages
ARGMAX_PARTS = 256


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, [b, V] -> [b] int64, the first of equal maxima as
    torch.argmax gives; over a long vocabulary in two stages (the best of each of 256 parts,
    then the best part), since one row reduced whole runs on one block of the GPU."""
    b, v = x.shape
    if v < SPLIT_ARGMAX:
        return x.argmax(dim=-1)
    width = -(-v // ARGMAX_PARTS)
    padded = F.pad(x, (0, ARGMAX_PARTS * width - v), value=float("-inf"))  # after the real
    best, at = padded.view(b, ARGMAX_PARTS, width).max(dim=-1)  # [b, parts]
    part = best.argmax(dim=-1, keepdim=True)  # [b, 1]: the first part holding the maximum
    return (part * width + at.gather(1, part)).squeeze(1)


def pick(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
         top_p: torch.Tensor, min_p: torch.Tensor, keys: torch.Tensor, index: torch.Tensor,
         vocab_ids: torch.Tensor, *, sample: bool, filtered: bool) -> torch.Tensor:
    """The next token per row, [b] int64, from logits [b, V] float32 (EOS already masked
    where min_new_tokens says so, penalties applied), each row by its own parameters:
    temperature [b] float32 (0: greedy), top_k [b], top_p [b], min_p [b]. sample: some row may
    sample (else every row is greedy and no noise is drawn); filtered: some row may have
    top_k, top_p or min_p on (else no sort)."""
    greedy = first_argmax(logits)
    if not sample:
        return greedy
    hot = temperature > 0
    scores = logits / torch.where(hot, temperature, 1.0)[:, None]
    if filtered:
        scores = filter_scores(scores, top_k, top_p, min_p)
    drawn = first_argmax(scores + gumbel(keys, index, vocab_ids))
    return torch.where(hot, drawn, greedy)
