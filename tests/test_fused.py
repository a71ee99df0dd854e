"""The fused elementwise kernels of graphrun's Llama (models/causal/fused.py): each computes what
its eager ops compute (the residual exactly, RoPE exactly, the norm and silu(gate) * up to a
rounding), in Triton's interpreter on the CPU and compiled on a GPU; without them (the CPU,
kernel=False, a kernel that failed) the eager ops run, and a failure is said on the graph it
happened in. The builtin Llama's step with the kernels equals its step without them: the same
greedy tokens in float32, close logits in bfloat16; transformers' tokens on a GPU."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from graphrun.generate import GenerateConfig, build_engine, build_llama
from graphrun.models.causal import fused, paged_attention
from graphrun.models.causal.kv_cache import PagedCache, StepKV

ROOT = Path(__file__).resolve().parents[1]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (shape, with a residual add, eps, scale of x): odd widths, one row, rows of a strided view
NORM_CASES = [((3, 5, 77), True, 1e-5, 1.0), ((7, 33), False, 1e-6, 300.0),
              ((1, 1, 256), True, 1e-5, 1e-3), ((2, 1, 1000), True, 1e-6, 4.0)]
# (b, q, heads, head_dim): head_dim no power of two, one decode row, a prefill's columns
ROPE_CASES = [(2, 3, 10, 10), (4, 1, 40, 128), (1, 7, 3, 64), (3, 2, 5, 6)]
# (rows shape, width, fused gate_up halves or two tensors)
SILU_CASES = [((4, 3), 3000, True), ((5,), 17, False), ((1, 1), 1024, True), ((2, 2), 2500, False)]
PROMPTS = [[3, 8, 1], [9] * 12, [4, 5, 6, 7, 8], [2], [11, 12, 13, 14, 15, 16, 17]]
IDS = [f"rec-{i}" for i in range(len(PROMPTS))]


def within(got: torch.Tensor, want: torch.Tensor, ulps: float) -> bool:
    """Each value within `ulps` units of the dtype's precision of want (relative)."""
    scale = torch.finfo(want.dtype).eps * want.float().abs() + torch.finfo(want.dtype).tiny
    return bool(((got.float() - want.float()).abs() <= ulps * scale).all())


def strides(t: torch.Tensor) -> list[int]:
    """The memory layout: the strides of the dims longer than one."""
    return [s for s, n in zip(t.stride(), t.shape) if n > 1]


def kernel_failures(device: str) -> list[str]:
    """Each kernel on every case and dtype against its eager ops, on `device`; the failures,
    as lines (none when every kernel computes what the eager ops do)."""
    failures = []
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, dtype, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    for dtype in DTYPES:
        half = dtype != torch.float32
        for shape, add, eps, scale in NORM_CASES:
            name = f"add_rms_norm {shape} add={add} {dtype}"
            # x a strided view: the rows of each [.., 2, n] pair's second, as last_hidden's
            x = rand(*shape[:-1], 2, shape[-1], dtype=dtype, scale=scale).select(-2, 1)
            delta = rand(*shape, dtype=dtype, scale=scale) if add else None
            weight = (rand(shape[-1], dtype=torch.float32) * 0.3 + 1).to(dtype)
            res, out = fused._add_rms_norm(x, delta, weight, eps)
            want_res, want_out = fused.add_rms_norm_eager(x, delta, weight, eps)
            if not torch.equal(res, want_res):
                failures.append(f"{name}: the residual differs")
            if out.shape != want_out.shape or out.dtype != want_out.dtype:
                failures.append(f"{name}: {out.shape} {out.dtype}, not {want_out.shape} "
                                f"{want_out.dtype}")
            elif not within(out, want_out, 2 if half else 8):
                err = (out.float() - want_out.float()).abs().max().item()
                failures.append(f"{name}: normed output differs by {err:.3g}")
        for b, q, heads, dim in ROPE_CASES:
            name = f"rope {(b, q, heads, dim)} {dtype}"
            # qk a view of a fused qkv projection's output, as the model's is
            qkv = rand(b, q, (heads + 2) * dim, dtype=dtype)
            qk = qkv[..., :heads * dim].view(b, q, heads, dim)
            positions = torch.randint(0, 4000, (b, q), generator=gen).to(device)
            freqs = positions[..., None].float() * (
                10000.0 ** -(torch.arange(0, dim, 2, device=device).float() / dim))
            angles = torch.cat((freqs, freqs), dim=-1)[:, None]
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            got, want = fused._rope(qk, cos, sin), fused.rope_eager(qk, cos, sin)
            if got.shape != want.shape or strides(got) != strides(want):
                failures.append(f"{name}: {got.shape} {got.stride()}, not {want.shape} "
                                f"{want.stride()}")
            elif not torch.equal(got, want):
                err = (got.float() - want.float()).abs().max().item()
                failures.append(f"{name}: differs by {err:.3g}")
        for rows, n, halves in SILU_CASES:
            name = f"silu_mul {rows} {n} {dtype}"
            if halves:
                gate, up = rand(*rows, 2 * n, dtype=dtype, scale=3.0).chunk(2, dim=-1)
            else:
                gate, up = rand(*rows, n, dtype=dtype, scale=3.0), rand(*rows, n, dtype=dtype)
            got, want = fused._silu_mul(gate, up), fused.silu_mul_eager(gate, up)
            if got.shape != want.shape or got.dtype != want.dtype:
                failures.append(f"{name}: {got.shape} {got.dtype}")
            elif not within(got, want, 2 if half else 64):
                err = (got.float() - want.float()).abs().max().item()
                failures.append(f"{name}: differs by {err:.3g}")
    if fused.failure():
        failures.append(f"a kernel failed: {fused.failure()}")
    return failures


def tiny(device="cpu", dtype=torch.float32, **kw):
    return build_llama(**{**dict(layers=2, d_model=64, heads=4, kv_heads=2, vocab=128,
                                 max_len=64), **kw}, device=device, dtype=dtype)


def greedy(model, device="cpu", dtype=torch.float32, kernels=True):
    """The model's greedy completions of PROMPTS, its fused kernels on or off."""
    model.fused_kernels = kernels
    gen = build_engine(model, GenerateConfig(max_new_tokens=16), slots=4, max_prompt=16,
                       rows=[1, 4], device=device, dtype=dtype, block_size=4)
    try:
        return [c.token_ids for c in gen.generate(PROMPTS, IDS)], gen.graphs()
    finally:
        gen.close()
        model.fused_kernels = True


def model_failures(device: str) -> list[str]:
    """The builtin Llama in float32 with the kernels and without: the same greedy tokens, no
    kernel failed."""
    model = tiny(device)
    fused_tokens, graphs = greedy(model, device)
    plain_tokens, _ = greedy(model, device, kernels=False)
    failures = [] if fused_tokens == plain_tokens else [
        f"tokens differ: {fused_tokens} against {plain_tokens}"]
    if fused.failure() or paged_attention.failure():
        failures.append(f"a kernel failed: {fused.failure() or paged_attention.failure()}")
    failures += [f"graph {g['kind']} {g['shape']}: {g['reason']}" for g in graphs
                 if g["reason"] and "failed" in g["reason"]]
    return failures


def in_interpreter(call: str) -> subprocess.CompletedProcess:
    """`call` (an expression giving a list of failures) in a process running Triton's
    interpreter, patched to round as a GPU does (tests/triton_interpreter.py)."""
    from tests.triton_interpreter import run_interpreted

    return run_interpreted("import tests.test_fused as t", call)


def test_the_kernels_in_the_interpreter_compute_what_the_eager_ops_do():
    pytest.importorskip("triton", reason="the fused kernels are written in Triton")
    p = in_interpreter("t.kernel_failures('cpu')")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]


def test_in_the_interpreter_the_llamas_fused_step_gives_its_unfused_tokens():
    pytest.importorskip("triton", reason="the fused kernels are written in Triton")
    p = in_interpreter("t.model_failures('cpu')")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]


def test_on_the_cpu_outside_the_interpreter_the_eager_ops_run(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    monkeypatch.setattr(fused.SWITCH, "failures", [])

    def never(*args):
        raise AssertionError("a kernel was launched on the CPU")

    for name in ("_add_rms_norm", "_rope", "_silu_mul"):
        monkeypatch.setattr(fused, name, never)
    x, delta, w = torch.randn(3, 40), torch.randn(3, 40), torch.rand(40) + 0.5
    assert not fused.usable(x)
    got = fused.add_rms_norm(x, delta, w, 1e-5)
    want = fused.add_rms_norm_eager(x, delta, w, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(got[0], x + delta)
    assert torch.allclose(got[1], w * (x + delta) * torch.rsqrt(
        (x + delta).pow(2).mean(-1, keepdim=True) + 1e-5), atol=1e-6)
    qk, cos, sin = torch.randn(2, 3, 6, 8), torch.randn(2, 1, 3, 8), torch.randn(2, 1, 3, 8)
    assert torch.equal(fused.rope(qk, cos, sin), fused.rope_eager(qk, cos, sin))
    gate, up = torch.randn(4, 10), torch.randn(4, 10)
    assert torch.equal(fused.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)
    assert fused.failure() is None


def test_the_eager_rope_is_llamas_rotate_half():
    qk, angles = torch.randn(2, 3, 5, 8), torch.randn(2, 1, 3, 4)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    x = qk.transpose(1, 2)
    x1, x2 = x[..., :4], x[..., 4:]
    want = torch.cat((x1 * cos[..., :4] - x2 * sin[..., :4],
                      x2 * cos[..., 4:] + x1 * sin[..., 4:]), -1)
    assert torch.allclose(fused.rope_eager(qk, cos, sin), want, atol=1e-6)


def test_what_the_kernels_cannot_take_runs_the_eager_ops(monkeypatch):
    """Another weight dtype (the eager product promotes), kernel=False: the eager ops, with no
    kernel launched and nothing recorded as a failure."""
    monkeypatch.setattr(fused.SWITCH, "failures", [])
    monkeypatch.setattr(fused, "usable", lambda t: True)

    def never(*args):
        raise AssertionError("a kernel was launched")

    for name in ("_add_rms_norm", "_rope", "_silu_mul"):
        monkeypatch.setattr(fused, name, never)
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    res, out = fused.add_rms_norm(x, x, torch.ones(16), 1e-5)
    assert out.dtype == torch.float32 and torch.equal(res, x + x)
    fused.add_rms_norm(x, x, torch.ones(16, dtype=torch.bfloat16), 1e-5, kernel=False)
    fused.rope(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8),
               kernel=False)
    fused.silu_mul(torch.randn(3), torch.randn(3), kernel=False)
    assert fused.failure() is None


def test_a_kernel_that_fails_leaves_the_eager_ops_and_is_not_tried_again(monkeypatch):
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("PTX .version 9.9 does not support .target sm_99\nsecond line")

    monkeypatch.setattr(fused.SWITCH, "failures", [])
    monkeypatch.setattr(fused, "usable", lambda t: not fused.SWITCH.failures)
    monkeypatch.setattr(fused, "_silu_mul", broken)
    monkeypatch.setattr(fused, "_rope", broken)
    gate, up = torch.randn(4, 10), torch.randn(4, 10)
    for _ in range(2):
        assert torch.equal(fused.silu_mul(gate, up), fused.silu_mul_eager(gate, up))
    qk, cos, sin = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4)
    assert torch.equal(fused.rope(qk, cos, sin), fused.rope_eager(qk, cos, sin))
    assert len(calls) == 1
    assert fused.failure() == "RuntimeError: PTX .version 9.9 does not support .target sm_99"


def failing_kernels(monkeypatch, device: str) -> tuple[list, list]:
    """(the tokens, the graphs) of the builtin Llama whose kernels all fail, on device."""
    monkeypatch.setattr(fused.SWITCH, "failures", [])
    monkeypatch.setattr(fused, "usable", lambda t: not fused.SWITCH.failures)

    def broken(*args):
        raise RuntimeError("no kernel image is available for execution on the device")

    for name in ("_add_rms_norm", "_rope", "_silu_mul"):
        monkeypatch.setattr(fused, name, broken)
    return greedy(tiny(device), device)


def test_a_kernel_computing_other_values_than_the_eager_ops_is_given_up(monkeypatch):
    """The warm-up's check: a kernel that ran yet disagrees beyond rounding leaves the eager
    ops for every later step, and failure() names it; agreeing outputs give nothing up."""
    monkeypatch.setattr(fused.SWITCH, "failures", [])
    x = torch.randn(3, 8)
    fused.check("silu_mul", x, x + 1e-7)
    fused.check("add_rms_norm", (x, x.bfloat16()), (x, x.bfloat16()))
    assert fused.failure() is None
    fused.check("rope", x, x.clone().index_fill_(1, torch.tensor([5]), 9.0))
    assert "the fused rope kernel differs from the eager ops on cpu" in fused.failure()
    assert not fused.usable(x)


def test_a_failed_kernel_leaves_the_tokens_as_the_eager_ops_give_them(monkeypatch):
    want, _ = greedy(tiny(), kernels=False)
    tokens, _ = failing_kernels(monkeypatch, "cpu")
    assert tokens == want
    assert fused.failure() == "RuntimeError: no kernel image is available for execution on the device"


def test_the_llama_without_its_kernels_computes_the_steps_it_computed_before():
    """The layers' residual adds moved next to the norms: a prefill and a decode step equal the
    pre-norm blocks written out in torch's ops."""
    model = tiny(layers=3)
    layout = model.layout
    cache = PagedCache(layout, 8, 4, torch.float32, torch.device("cpu"))
    tokens = torch.tensor([[5, 9, 17, 3, 40, 2]])
    kv = StepKV(cache, segment=torch.zeros(6, dtype=torch.long), positions=torch.arange(6),
                starts=torch.tensor([0, 6, 6], dtype=torch.int32), slots=torch.arange(4, 10),
                last=torch.tensor([5]))
    with torch.no_grad():
        got = model(tokens, torch.arange(6)[None], kv)
        want = written_out(model, tokens, torch.arange(6)[None])
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def written_out(model, tokens, positions):
    """One prompt's last logits through the blocks as transformers writes them, on dense
    causal attention."""
    from torch.nn import functional as F

    s = model.shape
    x = model.model.embed_tokens(tokens)
    freqs = positions[..., None].float() * model.inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]
    cos, sin = angles.cos(), angles.sin()

    def norm(m, t):
        return m.weight * F.rms_norm(t, (t.shape[-1],), eps=m.eps)

    def rotate(t):
        half = t.shape[-1] // 2
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin

    b, q = tokens.shape
    for layer in model.model.layers:
        a = layer.self_attn
        h = norm(layer.input_layernorm, x)
        qs = rotate(a.q_proj(h).view(b, q, s.heads, s.head_dim).transpose(1, 2))
        ks = rotate(a.k_proj(h).view(b, q, s.kv_heads, s.head_dim).transpose(1, 2))
        vs = a.v_proj(h).view(b, q, s.kv_heads, s.head_dim).transpose(1, 2)
        groups = s.heads // s.kv_heads
        y = F.scaled_dot_product_attention(qs, ks.repeat_interleave(groups, 1),
                                           vs.repeat_interleave(groups, 1), is_causal=True)
        x = x + a.o_proj(y.transpose(1, 2).reshape(b, q, -1))
        h = norm(layer.post_attention_layernorm, x)
        m = layer.mlp
        x = x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))
    return model.lm_head(norm(model.model.norm, x[:, -1])).float()


def decode_logits(model, rows: int, kernels: bool, seed: int = 0) -> torch.Tensor:
    """One decode step's logits [rows, V] over a seeded cache, rows of different lengths."""
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    gen = torch.Generator(device).manual_seed(seed)
    block_size, per_row = 16, 6
    cache = PagedCache(model.layout, 1 + rows * per_row, block_size, dtype, device)
    for t in (*cache.k, *cache.v):  # drawn in float32: the same values in every dtype
        t.copy_(torch.randn(t.shape, generator=gen, device=device))
    table = (torch.arange(rows * per_row, device=device) + 1).view(rows, per_row).int()
    lens = torch.randint(1, per_row * block_size, (rows,), generator=gen, device=device).int()
    tokens = torch.randint(0, model.vocab, (rows, 1), generator=gen, device=device)
    model.fused_kernels = kernels
    try:
        with torch.no_grad():
            return model(tokens, (lens - 1).long()[:, None],
                         StepKV(cache, block_table=table, seq_lens=lens))
    finally:
        model.fused_kernels = True


def rotary_failures(device: str) -> list[str]:
    """A decode step of the Llama in float16 (and bfloat16 on a GPU), RoPE inside the decode
    kernel (kv_cache.attend_rotary) against RoPE by its own kernel first: the same logits, bit
    for bit."""
    failures = []
    for dtype in (torch.float16, torch.bfloat16) if device == "cuda" else (torch.float16,):
        model = tiny(device, dtype, layers=2, d_model=128, heads=4, kv_heads=2, vocab=256)
        inside = decode_logits(model, 6, True)
        real = paged_attention.takes_rotary
        paged_attention.takes_rotary = lambda q, cos: False
        try:
            first = decode_logits(model, 6, True)
        finally:
            paged_attention.takes_rotary = real
        if not torch.equal(inside, first):
            failures.append(f"{dtype}: logits differ by {(inside - first).abs().max().item()}")
    if fused.failure() or paged_attention.failure():
        failures.append(f"a kernel failed: {fused.failure() or paged_attention.failure()}")
    return failures


def test_in_the_interpreter_rope_inside_the_decode_kernel_gives_the_same_logits():
    pytest.importorskip("triton", reason="the fused kernels are written in Triton")
    p = in_interpreter("t.rotary_failures('cpu')")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]


@pytest.mark.cuda
def test_on_the_gpu_rope_inside_the_decode_kernel_gives_the_same_logits():
    pytest.importorskip("triton", reason="the fused kernels are written in Triton")
    assert rotary_failures("cuda") == []


@pytest.mark.cuda
def test_on_the_gpu_the_kernels_compute_what_the_eager_ops_do(monkeypatch):
    pytest.importorskip("triton", reason="the fused kernels are written in Triton")
    monkeypatch.setattr(fused.SWITCH, "failures", [])
    assert kernel_failures("cuda") == []


@pytest.mark.cuda
def test_on_the_gpu_the_llamas_fused_step_gives_its_unfused_tokens_in_float32():
    pytest.importorskip("triton", reason="the fused kernels are written in Triton")
    assert model_failures("cuda") == []
    _, graphs = greedy(tiny("cuda"), "cuda")
    assert all(g["status"] == "captured" for g in graphs), graphs


@pytest.mark.cuda
def test_on_the_gpu_a_failed_kernel_is_said_on_the_graph_it_failed_in(monkeypatch):
    want, _ = greedy(tiny("cuda"), "cuda", kernels=False)
    tokens, graphs = failing_kernels(monkeypatch, "cuda")
    assert tokens == want
    said = [g for g in graphs if g["reason"] and "fused elementwise kernels failed" in g["reason"]]
    assert len(said) == 1 and "no kernel image is available" in said[0]["reason"], graphs
    assert all(g["status"] == "captured" for g in graphs), graphs


@pytest.mark.cuda
def test_on_the_gpu_the_llamas_fused_bf16_step_is_as_near_float32_as_its_unfused_step():
    """bf16 rounds in a few other places: the fused step's logits are no further from the
    float32 step's than the unfused step's are (twice that, at most, from the unfused)."""
    pytest.importorskip("triton", reason="the fused kernels are written in Triton")
    shape = dict(layers=4, d_model=256, heads=8, kv_heads=2, vocab=1000, max_len=128)
    exact = decode_logits(tiny("cuda", **shape), 24, kernels=False)
    model = tiny("cuda", torch.bfloat16, **shape)
    got, plain = decode_logits(model, 24, True), decode_logits(model, 24, False)
    noise = (plain - exact).abs().max().item()
    assert fused.failure() is None
    assert (got - plain).abs().max().item() <= 2 * noise + 1e-3, (got - plain).abs().max()
    assert (got - exact).abs().max().item() <= 2 * noise + 1e-3


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["llama", "llama-tied-bias", "qwen3", "mistral"])
def test_on_the_gpu_graphruns_fused_llama_gives_transformers_greedy_tokens(tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("triton", reason="the fused kernels are written in Triton")
    from graphrun.models.causal.llama import find_checkpoint, load_checkpoint
    from tests.generate_models import IDS as HF_IDS
    from tests.generate_models import PROMPTS as HF_PROMPTS
    from tests.generate_models import hf_greedy
    from tests.test_generate_native import save

    folder = save(tmp_path / kind, kind)
    found = find_checkpoint(folder, "AutoModelForCausalLM", {})
    ours = load_checkpoint(found, torch.device("cuda"), torch.float32)
    gen = build_engine(ours, GenerateConfig(max_new_tokens=10), slots=8, max_prompt=16,
                       device="cuda")
    try:
        got = [c.token_ids for c in gen.generate(HF_PROMPTS, HF_IDS)]
    finally:
        gen.close()
    no_hub = ({"use_kernels": False} if hasattr(transformers.PreTrainedModel, "use_kernels")
              else {})  # transformers 5.25 loads hub kernels by default
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, **no_hub).eval()
    assert got == hf_greedy(theirs, HF_PROMPTS, max_new_tokens=10)
    assert fused.failure() is None
