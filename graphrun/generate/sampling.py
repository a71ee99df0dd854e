"""Picking the next token inside the captured step: repetition, presence and frequency
penalties, greedy, temperature, min-p, top-k, top-p, with a counter-based random draw; and the
log-probabilities of what was picked.

The draw is Gumbel-max: argmax(scores + g), g = -log(-log(u)), where u for (row, token) is a
hash of the row's record key (seed and record id, hashed on the host), the index of the token
in the completion and the token id. No generator state, no torch.multinomial (which syncs and
whose stream follows the batch layout): a record's draws are the same in any row, batch size,
bucket, process or GPU, which makes a seeded completion reproducible under resume and --gpus.
Everything here is elementwise, sort or argmax over static shapes: safe inside a CUDA graph.

On a GPU the argmaxes and the draw's noise run in one Triton kernel (generate/pick_kernels.py)
that reads the scores once and makes the noise where it adds it, instead of a dozen torch ops
over [rows, V] int64 tensors; it computes the same values as the torch ops here (checked on the
job's GPU before the first step: check_kernel), which run where it cannot.
"""

from __future__ import annotations

import hashlib

import torch
from torch.nn import functional as F

from graphrun.base.triton_switch import KernelSwitch


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


def row_streams(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[b] int64: the stream of each row's (record, place in the completion)."""
    return mix64(keys + index * STEP)


def uniforms(keys: torch.Tensor, index: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """u in (0, 1), float32: keys [b] int64, index [b] int64 (token's place in the
    completion), vocab_ids [V] int64 -> [b, V]."""
    return _uniforms(row_streams(keys, index), vocab_ids)


def _uniforms(streams: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    z = mix64(streams[:, None] + (vocab_ids[None, :] + 1) * GOLDEN)  # [b, V]
    top24 = _shift_right(z, 40).to(torch.float32)  # exact in float32
    return (top24 + 0.5) * (1.0 / (1 << 24))


def gumbel(streams: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [b, V], float32, of each row's stream [b] (row_streams)."""
    return -torch.log(-torch.log(_uniforms(streams, vocab_ids)))


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
    torch.argmax gives (the kernel's where it takes x)."""
    if _kernel_takes(x):
        try:
            return _kernel_pick(x)
        except Exception as err:  # noqa: BLE001 - a kernel that cannot run: torch's ops
            give_up(err)
    return first_argmax_eager(x)


def first_argmax_eager(x: torch.Tensor) -> torch.Tensor:
    """first_argmax in torch's ops: over a long vocabulary in two stages (the best of each of
    256 parts, then the best part), since one row reduced whole runs on one block of the
    GPU."""
    b, v = x.shape
    if v < SPLIT_ARGMAX:
        return x.argmax(dim=-1)
    width = -(-v // ARGMAX_PARTS)
    padded = F.pad(x, (0, ARGMAX_PARTS * width - v), value=float("-inf"))  # after the real
    best, at = padded.view(b, ARGMAX_PARTS, width).max(dim=-1)  # [b, parts]
    part = best.argmax(dim=-1, keepdim=True)  # [b, 1]: the first part holding the maximum
    return (part * width + at.gather(1, part)).squeeze(1)


def draw(scores: torch.Tensor, temperature: torch.Tensor | None, keys: torch.Tensor,
         index: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Each row's Gumbel-max draw from scores [b, V] float32 with the noise of its stream
    (row_streams of keys [b] and index [b] int64), [b] int64. temperature [b] float32: the
    scores divided by it first, and where it is 0 the row's first_argmax instead; None: the
    scores as they are (divided already)."""
    if (_kernel_takes(scores) and all(t.dtype == torch.int64 and t.is_contiguous()
                                      for t in (keys, index))
            and (temperature is None or (temperature.dtype == torch.float32
                                         and temperature.is_contiguous()))):
        try:
            return _kernel_pick(scores, temperature=temperature, keys=keys, index=index)
        except Exception as err:  # noqa: BLE001
            give_up(err)
    return draw_eager(scores, temperature, keys, index, vocab_ids)


def draw_eager(scores, temperature, keys, index, vocab_ids) -> torch.Tensor:
    """draw in torch's ops."""
    noise = gumbel(row_streams(keys, index), vocab_ids)
    if temperature is None:
        return first_argmax_eager(scores + noise)
    hot = temperature > 0
    drawn = first_argmax_eager(scores / torch.where(hot, temperature, 1.0)[:, None] + noise)
    return torch.where(hot, drawn, first_argmax_eager(scores))


def pick(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
         top_p: torch.Tensor, min_p: torch.Tensor, keys: torch.Tensor, index: torch.Tensor,
         vocab_ids: torch.Tensor, *, sample: bool, filtered: bool) -> torch.Tensor:
    """The next token per row, [b] int64, from logits [b, V] float32 (EOS already masked
    where min_new_tokens says so, penalties applied), each row by its own parameters:
    temperature [b] float32 (0: greedy), top_k [b], top_p [b], min_p [b]. sample: some row may
    sample (else every row is greedy and no noise is drawn); filtered: some row may have
    top_k, top_p or min_p on (else no sort)."""
    if not sample:
        return first_argmax(logits)
    if not filtered:
        return draw(logits, temperature, keys, index, vocab_ids)
    hot = temperature > 0
    scores = filter_scores(logits / torch.where(hot, temperature, 1.0)[:, None], top_k, top_p,
                           min_p)
    return torch.where(hot, draw(scores, None, keys, index, vocab_ids), first_argmax(logits))


# -- the kernel: when it runs, and the check that it computes what the torch ops do ---------

PICK_BLOCK = 1024  # columns one program of pick_parts reads
PICK_ROWS = 8  # rows one program of pick_rows chooses for
SWITCH = KernelSwitch("graphrun.generate.pick_kernels")  # imported on a GPU's first pick
_checked: dict[tuple, bool] = {}  # (device, vocab) -> the kernel agreed with torch's ops


def _kernel_takes(x: torch.Tensor) -> bool:
    """Whether the kernel can take scores x: [b, V] float32 with unit column stride, on a
    GPU (or the CPU under Triton's interpreter), outside torch.compile's tracing (inductor
    fuses the torch ops itself), while the kernel has not failed, with Triton importable."""
    if torch.compiler.is_compiling():
        return False
    return (x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1
            and x.shape[1] > 0 and SWITCH.on(x.device))


def give_up(err: BaseException) -> None:
    """The kernel failed, or computed other values than the torch ops: torch's ops from now
    on, in this process."""
    SWITCH.give_up(err)


def kernel_failure() -> str | None:
    """Why the pick's kernel is no longer used in this process, or None."""
    return SWITCH.failure()


def _kernel_pick(x: torch.Tensor, *, temperature: torch.Tensor | None = None,
                 keys: torch.Tensor | None = None,
                 index: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels' picks [b] int64: keys None, first_argmax(x); else draw(x, temperature,
    keys, index). pick_parts: per row and part its best and first column (the scores as they
    are, the draw's, or both); pick_rows: per row the first part holding its best, and the
    draw where its temperature is above 0."""
    b, v = x.shape
    parts = -(-v // PICK_BLOCK)
    greedy, drawn = keys is None or temperature is not None, keys is not None

    def pair(on: bool) -> list[torch.Tensor]:  # a part's best and column; x: never written
        return ([torch.empty((b, parts), dtype=torch.float32, device=x.device),
                 torch.empty((b, parts), dtype=torch.int32, device=x.device)] if on else [x, x])

    outs = pair(greedy) + pair(drawn)
    token = torch.empty(b, dtype=torch.int64, device=x.device)
    if b:
        k = SWITCH.kernels
        given = [t if t is not None else x for t in (temperature, keys, index)]
        k.pick_parts[(b, parts)](x, *given, *outs, v, x.stride(0), parts, BLOCK=PICK_BLOCK,
                                 GREEDY=greedy, DRAW=drawn, DIVIDE=temperature is not None,
                                 num_warps=4, enable_fp_fusion=False)
        k.pick_rows[(-(-b // PICK_ROWS),)](*outs, given[0], token, b, parts, R=PICK_ROWS,
                                           BP=max(2, 1 << (parts - 1).bit_length()),
                                           GREEDY=greedy, DRAW=drawn, num_warps=4)
    return token


def check_kernel(device: torch.device, vocab: int) -> list[str]:
    """The kernel against torch's ops on `device` at `vocab` columns, on seeded scores with
    ties and -inf (as filtering leaves them), in each way a step calls it: a kernel that
    differs in any pick is given up (torch's ops run, kernel_failure() says why). Once per
    device and vocabulary; what ran by the kernel, for the warm-up's report."""
    key = (str(device), vocab)
    if key not in _checked:
        _checked[key] = _check(torch.device(device), vocab)
    return ["pick"] if _checked[key] and not SWITCH.failures else []


def _check(device: torch.device, vocab: int) -> bool:
    rows = 16
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(rows, vocab, generator=gen, device=device) * 4
    if not _kernel_takes(x):
        return False
    x[1, : vocab // 2] = float("-inf")
    x[2, :: 2] = x[2, 1]  # equal maxima: the first wins
    keys = torch.randint(-2**62, 2**62, (rows,), generator=gen, device=device)
    index = torch.arange(rows, device=device)
    vocab_ids = torch.arange(vocab, device=device)
    temperature = torch.rand(rows, generator=gen, device=device) + 0.5
    temperature[3], temperature[4] = 0.0, 1.0  # a greedy row, an undivided one
    try:
        pairs = [(_kernel_pick(x), first_argmax_eager(x)),
                 (_kernel_pick(x, temperature=temperature, keys=keys, index=index),
                  draw_eager(x, temperature, keys, index, vocab_ids)),
                 (_kernel_pick(x, keys=keys, index=index),
                  draw_eager(x, None, keys, index, vocab_ids))]
    except Exception as err:  # noqa: BLE001 - a kernel that cannot compile here
        give_up(err)
        return False
    wrong = int(sum((got != want).sum() for got, want in pairs))
    if wrong:
        give_up(RuntimeError(f"the pick kernel differs from torch's ops on {device} in {wrong} "
                             f"of {3 * rows} picks"))
    return not wrong
