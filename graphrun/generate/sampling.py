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
            return _kernel_pick(x, greedy=True)[0]
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


def draw(scores: torch.Tensor, divisor: torch.Tensor | None, streams: torch.Tensor,
         vocab_ids: torch.Tensor, *, greedy: bool
         ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(first_argmax(scores) if greedy, else None; first_argmax(scores / divisor[:, None] +
    noise)): the Gumbel-max draw of each row's stream [b] (row_streams), divisor [b] float32
    (None: the scores are divided already)."""
    if _kernel_takes(scores) and streams.is_contiguous() and (
            divisor is None or (divisor.dtype == torch.float32 and divisor.is_contiguous())):
        try:
            return _kernel_pick(scores, greedy=greedy, divisor=divisor, streams=streams)
        except Exception as err:  # noqa: BLE001
            give_up(err)
    return draw_eager(scores, divisor, streams, vocab_ids, greedy=greedy)


def draw_eager(scores, divisor, streams, vocab_ids, *, greedy: bool):
    """draw in torch's ops."""
    best = first_argmax_eager(scores) if greedy else None
    if divisor is not None:
        scores = scores / divisor[:, None]
    return best, first_argmax_eager(scores + gumbel(streams, vocab_ids))


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
    hot = temperature > 0
    divisor = torch.where(hot, temperature, 1.0)
    streams = row_streams(keys, index)
    if filtered:
        greedy = first_argmax(logits)
        scores = filter_scores(logits / divisor[:, None], top_k, top_p, min_p)
        _, drawn = draw(scores, None, streams, vocab_ids, greedy=False)
    else:
        greedy, drawn = draw(logits, divisor, streams, vocab_ids, greedy=True)
    return torch.where(hot, drawn, greedy)


# -- the kernel: when it runs, and the check that it computes what the torch ops do ---------

PICK_BLOCK = 1024  # columns one program of the kernel reads
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


def _kernel_pick(x: torch.Tensor, *, greedy: bool, divisor: torch.Tensor | None = None,
                 streams: torch.Tensor | None = None):
    """(greedy picks or None, drawn picks or None) of the kernel: per row and part its best
    and first column, then the first part holding the row's best."""
    b, v = x.shape
    parts = -(-v // PICK_BLOCK)
    draw_ = streams is not None

    def pair(on: bool) -> list[torch.Tensor]:  # a part's best and column; x: never written
        return ([torch.empty((b, parts), dtype=torch.float32, device=x.device),
                 torch.empty((b, parts), dtype=torch.int32, device=x.device)] if on else [x, x])

    outs = pair(greedy) + pair(draw_)
    if b:
        SWITCH.kernels.pick_parts[(b, parts)](
            x, divisor if divisor is not None else x, streams if draw_ else x, *outs,
            v, x.stride(0), parts, BLOCK=PICK_BLOCK, GREEDY=greedy, DRAW=draw_,
            DIVIDE=divisor is not None, num_warps=4, enable_fp_fusion=False)

    def best(values, at):
        part = values.argmax(dim=-1, keepdim=True)  # the first part holding the maximum
        return at.gather(1, part).squeeze(1).long()

    return (best(*outs[:2]) if greedy else None, best(*outs[2:]) if draw_ else None)


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
    divisor = torch.rand(rows, generator=gen, device=device) + 0.5
    divisor[3] = 1.0
    keys = torch.randint(-2**62, 2**62, (rows,), generator=gen, device=device)
    index = torch.arange(rows, device=device)
    streams = row_streams(keys, index)
    vocab_ids = torch.arange(vocab, device=device)
    try:
        want = draw_eager(x, divisor, streams, vocab_ids, greedy=True)
        got = _kernel_pick(x, greedy=True, divisor=divisor, streams=streams)
        want_filtered = draw_eager(x, None, streams, vocab_ids, greedy=False)[1]
        got_filtered = _kernel_pick(x, greedy=False, streams=streams)[1]
    except Exception as err:  # noqa: BLE001 - a kernel that cannot compile here
        give_up(err)
        return False
    wrong = int((got[0] != want[0]).sum() + (got[1] != want[1]).sum()
                + (got_filtered != want_filtered).sum())
    if wrong:
        give_up(RuntimeError(f"the pick kernel differs from torch's ops on {device} in {wrong} "
                             f"of {3 * rows} picks"))
    return not wrong
