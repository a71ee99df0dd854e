"""Decode attention over a KV cache in blocks (models/causal/paged_attention.py): the reference
equals dense attention over the same keys laid out contiguously, whatever blocks the table
names; the step's key lands in its slot; padded rows stay finite; the prefill's write lands in
its slots. The Triton kernel equals the reference in Triton's interpreter (CPU) and on a GPU,
also replayed from one CUDA graph while the lengths and tables change between replays."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from graphrun.models.causal import paged_attention

ROOT = Path(__file__).resolve().parents[1]


def make_step(lens, heads, kv_heads, dim, *, block_size=16, max_blocks=None, padded=(),
              dtype=torch.float32, device="cpu", seed=0):
    """One decode step's tensors: rows of the given lengths in shuffled blocks of one cache
    (block 0 the trash block no row owns); rows in `padded` carry length 1 and a table of
    zeros, as the engine pads."""
    gen = torch.Generator().manual_seed(seed)
    b = len(lens)
    needed = [-(-n // block_size) for n in lens]
    max_blocks = max_blocks or max(needed)
    num_blocks = 1 + sum(needed) + 3
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(b, max_blocks, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    for r in range(b):
        if r in padded:
            seq_lens[r] = 1
            continue
        for i in range(needed[r]):
            table[r, i] = free.pop()

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return dict(q=rand(b, 1, heads, dim).transpose(1, 2),  # strided as a model's
                k_new=rand(b, 1, kv_heads, dim).transpose(1, 2),
                v_new=rand(b, 1, kv_heads, dim).transpose(1, 2),
                k_cache=rand(num_blocks, kv_heads, block_size, dim),
                v_cache=rand(num_blocks, kv_heads, block_size, dim),
                block_table=table.to(device), seq_lens=seq_lens.to(device), scale=dim ** -0.5)


def slot(step, r):
    """(block, offset) of row r's newest key."""
    pos = int(step["seq_lens"][r]) - 1
    bs = step["k_cache"].shape[2]
    return int(step["block_table"][r, pos // bs]), pos % bs


def dense(step, r):
    """Row r's attention [heads, d] by SDPA over its keys laid out contiguously, the new key
    at the end, kv heads repeated for each query head of their group."""
    length = int(step["seq_lens"][r])
    bs, heads = step["k_cache"].shape[2], step["q"].shape[1]
    blocks = step["block_table"][r, :-(-length // bs)].long()

    def keys(cache, new):
        kv = cache[blocks].transpose(0, 1).flatten(1, 2)[:, :length].clone()  # [kv_heads, L, d]
        kv[:, length - 1] = new[r, :, 0]
        return kv.repeat_interleave(heads // kv.shape[0], dim=0)

    k, v = keys(step["k_cache"], step["k_new"]), keys(step["v_cache"], step["v_new"])
    return F.scaled_dot_product_attention(step["q"][r], k, v, scale=step["scale"])[:, 0]


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_the_reference_equals_dense_attention_over_shuffled_blocks(heads, kv_heads):
    lens = [1, 5, 16, 17, 40, 64, 33]
    step = make_step(lens, heads, kv_heads, 16, max_blocks=5, seed=heads)
    want = torch.stack([dense(step, r) for r in range(len(lens))])
    out = paged_attention.paged_decode_reference(**step)
    assert out.shape == (len(lens), 1, heads, 16) and out.is_contiguous()
    assert torch.allclose(out[:, 0], want, atol=1e-5, rtol=1e-5)


def test_the_new_key_lands_in_its_slot_and_nothing_else_changes():
    step = make_step([3, 16, 17, 50], 4, 2, 8, max_blocks=4, seed=1)
    before_k, before_v = step["k_cache"].clone(), step["v_cache"].clone()
    paged_attention.paged_decode_reference(**step)
    changed = torch.zeros(step["k_cache"].shape[:1] + step["k_cache"].shape[2:3], dtype=bool)
    for r in range(4):
        block, offset = slot(step, r)
        assert torch.equal(step["k_cache"][block, :, offset], step["k_new"][r, :, 0])
        assert torch.equal(step["v_cache"][block, :, offset], step["v_new"][r, :, 0])
        changed[block, offset] = True
    keep = ~changed[:, None, :, None].expand_as(before_k)
    assert torch.equal(step["k_cache"][keep], before_k[keep])
    assert torch.equal(step["v_cache"][keep], before_v[keep])
    assert slot(step, 2) == (int(step["block_table"][2, 1]), 0)  # position 16: the next block


def test_padded_rows_and_garbage_past_the_lengths_stay_finite():
    """Unused slots hold NaN and inf (an uninitialised cache may); padded rows write the trash
    block and read only their own key."""
    lens = [1, 20, 1, 9]
    step = make_step(lens, 8, 2, 16, max_blocks=3, padded=(0, 2), seed=2)
    bs = 16
    owned = torch.zeros(step["k_cache"].shape[0], bs, dtype=bool)
    for r in (1, 3):
        for t in range(lens[r]):
            owned[int(step["block_table"][r, t // bs]), t % bs] = True
    junk = ~owned[:, None, :, None].expand_as(step["k_cache"])
    step["k_cache"][junk] = float("nan")
    step["v_cache"][junk] = float("inf")
    out = paged_attention.paged_decode_reference(**step)
    assert torch.isfinite(out).all()
    assert slot(step, 0) == (0, 0) == slot(step, 2)
    for r in (1, 3):
        assert torch.allclose(out[r, 0], dense(step, r), atol=1e-5, rtol=1e-5)


def test_write_prefill_fills_the_slots_it_is_given():
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.zeros(6, 2, 16, 8), torch.zeros(6, 2, 16, 8)
    # 20 tokens: the first 16 in block 4, the rest at the start of block 2
    slots = torch.cat([4 * 16 + torch.arange(16), 2 * 16 + torch.arange(4)])
    k, v = torch.randn(20, 2, 8, generator=gen), torch.randn(20, 2, 8, generator=gen)
    paged_attention.write_prefill(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[4].transpose(0, 1), k[:16])
    assert torch.equal(v_cache[2, :, :4].transpose(0, 1), v[16:])
    assert k_cache.count_nonzero() == k.count_nonzero()
    assert v_cache.count_nonzero() == v.count_nonzero()


def test_the_operators_give_the_calls_answers():
    """graphrun::paged_decode and graphrun::write_prefill, what torch.compile traces: the
    calls' answers, their declared cache writes and their shapes without data."""
    step = make_step([7, 30], 4, 2, 8, seed=4)
    twin = {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in step.items()}
    assert torch.equal(torch.ops.graphrun.paged_decode(**step), paged_attention.paged_decode(**twin))
    assert torch.equal(step["k_cache"], twin["k_cache"])
    k = torch.randn(3, 2, 8)
    torch.ops.graphrun.write_prefill(k, k, step["k_cache"], step["v_cache"],
                                     torch.tensor([0, 1, 17]))
    assert torch.equal(step["k_cache"][1, :, 1], k[2])
    # the declared mutations and the fake shapes hold as torch.compile traces them
    names = ("q", "k_new", "v_new", "k_cache", "v_cache", "block_table", "seq_lens", "scale")
    torch.library.opcheck(torch.ops.graphrun.paged_decode.default,
                          tuple(step[n] for n in names))
    torch.library.opcheck(torch.ops.graphrun.write_prefill.default,
                          (k, k, step["k_cache"], step["v_cache"], torch.tensor([0, 1, 17])))


def test_a_kernel_that_fails_leaves_the_reference_and_is_not_tried_again(monkeypatch):
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no kernel image for this GPU\nsecond line")

    # patches: the kernel's fallback is process state behind a registered torch op, no caller
    monkeypatch.setattr(paged_attention.SWITCH, "failures", [])
    monkeypatch.setattr(paged_attention, "usable", lambda q: not paged_attention.SWITCH.failures)
    monkeypatch.setattr(paged_attention, "_kernel_decode", broken)
    step = make_step([4, 9], 4, 2, 8, seed=5)
    want = paged_attention.paged_decode_reference(**{**step, "k_cache": step["k_cache"].clone(),
                                        "v_cache": step["v_cache"].clone()})
    for _ in range(2):
        assert torch.allclose(paged_attention.paged_decode(**step), want)
    assert len(calls) == 1 and paged_attention.failure() == "RuntimeError: no kernel image for this GPU"


def test_outside_the_interpreter_the_cpu_takes_the_reference():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    assert not paged_attention.usable(torch.zeros(1, 4, 1, 16))


# (lengths, heads, kv_heads, head_dim, block_size, max_blocks, padded rows, dtype): one share
# and several merged, rows past a share's start, GQA/MHA, a head_dim no power of two
CASES = [([1, 5, 16, 17, 64], 8, 2, 16, 16, 4, (), torch.float32),
         ([300, 7, 129], 8, 2, 32, 16, 20, (1,), torch.float32),
         ([40, 2], 4, 4, 12, 16, 3, (), torch.float32),
         ([200, 33, 1, 90], 6, 2, 64, 32, 8, (2,), torch.float16),
         ([600], 64, 1, 16, 16, 40, (), torch.float16),
         ([2048, 128, 1000], 32, 8, 128, 16, 128, (), torch.bfloat16),
         ([9, 250], 2, 1, 256, 16, 16, (), torch.bfloat16),
         ([33] * 70, 2, 2, 16, 16, 3, (5, 69), torch.float32)]


def compare(device: str) -> list[str]:
    """Each case through the kernel and through the reference (in float32); the failures, as
    lines. The interpreter multiplies bfloat16 tiles as integers (numpy has no bfloat16): those
    cases run on the GPU only."""
    failures = []
    for i, (lens, heads, kv_heads, dim, bs, max_blocks, padded, dtype) in enumerate(CASES):
        if device == "cpu" and dtype == torch.bfloat16:
            continue
        step = make_step(lens, heads, kv_heads, dim, block_size=bs, max_blocks=max_blocks,
                         padded=padded, dtype=dtype, device=device, seed=10 + i)
        if not paged_attention.usable(step["q"]):
            return [f"usable() is False for {dtype} on {device}"]
        want_step = {n: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point()
                     else t for n, t in step.items()}
        want = paged_attention.paged_decode_reference(**want_step)
        got = paged_attention._kernel_decode(**step)
        real = [r for r in range(len(lens)) if r not in padded]
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        err = (got[real].float() - want[real]).abs().max().item()
        name = f"case {i} {(lens[:4], heads, kv_heads, dim, bs, str(dtype))}"
        if got.shape != want.shape or not got.is_contiguous() or err > tol:
            failures.append(f"{name}: output {tuple(got.shape)}, error {err:.2e} > {tol}")
        if not torch.isfinite(got).all():
            failures.append(f"{name}: not finite")
        for r in real:
            block, offset = slot(step, r)
            for cache, ref in (("k_cache", want_step["k_cache"]), ("v_cache", want_step["v_cache"])):
                if not torch.equal(step[cache][block, :, offset].float(), ref[block, :, offset]):
                    failures.append(f"{name}: row {r}'s new key is not in its slot")
    return failures


def compare_rotary(device: str) -> list[str]:
    """The kernel applying RoPE itself (rotary: q and the new key as a Llama step hands them,
    before RoPE, strided views of one projection's output) against the kernel given q and k
    turned by the eager ops (fused.rope_eager): the same output and cache, bit for bit, in
    float16 (and bfloat16 on a GPU); takes_rotary refuses float32. The failures, as lines."""
    from graphrun.models.causal.fused import rope_eager

    failures = []
    for i, (lens, heads, kv_heads, dim, bs, dtype) in enumerate(
            [([1, 5, 17, 40], 8, 2, 16, 16, torch.float16), ([200, 33, 1], 4, 1, 64, 32,
                                                             torch.float16),
             ([160] * 3 + [7], 32, 8, 128, 16, torch.bfloat16)]):
        if device == "cpu" and dtype == torch.bfloat16:
            continue
        step = make_step(lens, heads, kv_heads, dim, block_size=bs, dtype=dtype, device=device,
                         seed=40 + i)
        b = len(lens)
        gen = torch.Generator().manual_seed(i)
        qkv = torch.randn(b, 1, (heads + 2 * kv_heads) * dim, generator=gen).to(device, dtype)
        qk = qkv[..., :(heads + kv_heads) * dim].view(b, 1, heads + kv_heads, dim)
        angles = torch.rand(b, 1, 1, dim // 2, generator=gen).repeat(1, 1, 1, 2) * 300
        cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
        raw = qk.transpose(1, 2)
        name = f"rotary case {i} ({dtype})"
        if not paged_attention.takes_rotary(raw[:, :heads], cos):
            failures.append(f"{name}: takes_rotary is False on {device}")
            continue
        if paged_attention.takes_rotary(raw[:, :heads].float(), cos.float()):
            failures.append(f"{name}: takes_rotary is True in float32")
        turned = rope_eager(qk, cos, sin)
        plain = {n: t.clone() if n.endswith("cache") else t for n, t in step.items()}
        plain.update(q=turned[:, :heads], k_new=turned[:, heads:])
        want = paged_attention._kernel_decode(**plain)
        step.update(q=raw[:, :heads], k_new=raw[:, heads:])
        got = paged_attention._kernel_decode(**step, rotary=(cos, sin))
        if not torch.equal(got, want):
            err = (got.float() - want.float()).abs().max().item()
            failures.append(f"{name}: output differs by up to {err:.2e}")
        for cache in ("k_cache", "v_cache"):
            if not torch.equal(step[cache], plain[cache]):
                failures.append(f"{name}: {cache} differs")
    return failures


def test_the_kernel_in_the_interpreter_equals_the_reference():
    pytest.importorskip("triton", reason="the paged decode kernel is written in Triton")
    from tests.triton_interpreter import run_interpreted

    p = run_interpreted("import tests.test_paged_attention as t",
                        "t.compare('cpu') + t.compare_rotary('cpu')")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]


@pytest.mark.cuda
def test_the_kernel_on_the_gpu_equals_the_reference():
    pytest.importorskip("triton", reason="the paged decode kernel is written in Triton")
    assert compare("cuda") == []
    assert compare_rotary("cuda") == []


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_captured_graph_serves_every_length(dtype):
    """Captured once for 5 rows and 24 blocks; replayed with new lengths, tables and inputs
    copied into its static buffers, each replay equals the reference."""
    pytest.importorskip("triton", reason="the paged decode kernel is written in Triton")
    rows, max_blocks, heads, kv_heads, dim = 5, 24, 8, 2, 64
    shapes = [[1, 1, 1, 1, 1], [384, 17, 1, 200, 64], [3, 380, 129, 16, 1], [90] * 5]
    steps = [make_step(lens, heads, kv_heads, dim, max_blocks=max_blocks, padded=(),
                       dtype=dtype, device="cuda", seed=20 + i) for i, lens in enumerate(shapes)]
    blocks = max(s["k_cache"].shape[0] for s in steps)
    static = {n: t.clone() for n, t in steps[0].items() if isinstance(t, torch.Tensor)}
    for name in ("k_cache", "v_cache"):
        static[name] = torch.zeros(blocks, kv_heads, 16, dim, dtype=dtype, device="cuda")
    scale = dim ** -0.5
    assert paged_attention.usable(static["q"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: Triton compiles outside the capture
        paged_attention.paged_decode(**static, scale=scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention.paged_decode(**static, scale=scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, step in enumerate(steps):
        for name, t in static.items():
            t.zero_()
            src = step[name]
            t[tuple(slice(0, n) for n in src.shape)].copy_(src)
        want_step = {n: t.float() if t.is_floating_point() else t for n, t in static.items()}
        want = paged_attention.paged_decode_reference(**want_step, scale=scale)
        graph.replay()
        assert torch.isfinite(out).all(), f"replay {i}"
        err = (out.float() - want).abs().max().item()
        assert err <= tol, f"replay {i} (lengths {shapes[i]}): error {err:.2e}"
        assert torch.equal(static["k_cache"].float(), want_step["k_cache"]), f"replay {i}"


def test_the_kernel_config_defaults_are_valid_and_a_bad_one_names_each_field():
    c = paged_attention.KernelConfig()
    assert paged_attention.CONFIG == c
    assert (c.tile, c.warps, c.stages, c.merge_warps, c.programs, c.max_splits) == (
        32, 4, 2, 4, 128, 16)
    paged_attention.KernelConfig(tile=16, warps=4, stages=2, programs=1, max_splits=1)
    with pytest.raises(ValueError) as e:
        paged_attention.KernelConfig(tile=24, warps=3, stages=0, programs=0, max_splits=12,
                                     merge_warps=5)
    for part in ("tile 24", "warps 3", "stages 0", "programs 0", "max_splits 12",
                 "merge_warps 5"):
        assert part in str(e.value)
    with pytest.raises(ValueError, match="tile 8"):
        paged_attention.KernelConfig(tile=8)


def test_the_warm_ups_check_gives_up_a_kernel_whose_output_or_written_key_differs(monkeypatch):
    """paged_attention.check (the warm-up's, on the job's GPU): an output or a written key
    beyond rounding from the reference's gives the kernel up, naming which; the reference's
    own values, and RoPE applied as the kernel applies it, pass."""
    from graphrun.models.causal.fused import rope_eager

    monkeypatch.setattr(paged_attention.SWITCH, "failures", [])
    step = make_step([5, 17], heads=4, kv_heads=2, dim=8, block_size=4)
    gen = torch.Generator().manual_seed(3)
    angles = torch.randn(2, 1, 1, 8, generator=gen)
    rotary = (angles.cos(), angles.sin())
    before = (step["k_cache"].clone(), step["v_cache"].clone())
    args = (step["block_table"], step["seq_lens"], step["scale"])

    def run(q, k):  # what a right kernel computes and writes: RoPE first, then the attention
        k_cache, v_cache = (c.clone() for c in before)
        out = paged_attention.paged_decode_reference(q, k, step["v_new"], k_cache, v_cache,
                                                     *args)
        return out, k_cache

    turned = [rope_eager(x.transpose(1, 2), *rotary) for x in (step["q"], step["k_new"])]
    out, k_cache = run(*turned)
    call = (step["q"], step["k_new"], step["v_new"], *before, *args)
    paged_attention.check(out, k_cache, call, rotary)
    assert paged_attention.failure() is None
    paged_attention.check(out + 1e-6, k_cache, call, rotary)  # rounding: kept
    assert paged_attention.failure() is None
    unturned, k_unturned = run(step["q"], step["k_new"])  # a kernel that forgot RoPE
    paged_attention.check(unturned, k_unturned, call, rotary)
    assert "the paged decode kernel's output differs from the reference on cpu" in \
        paged_attention.failure()
    monkeypatch.setattr(paged_attention.SWITCH, "failures", [])
    wrong = k_cache.clone()
    wrong[0] += 1  # the trash block written over: the output is right, the cache is not
    paged_attention.check(out, wrong, call, rotary)
    assert "the paged decode kernel's key cache differs" in paged_attention.failure()
