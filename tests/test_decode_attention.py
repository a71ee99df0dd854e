"""The decode-attention kernel (generate/decode_attention.py) against the general path it stands
in for (kv_cache._attend's scatter and scaled_dot_product_attention): the same attention output
and the same cache afterwards, over shapes that take each of its ways (one share of the columns
and several merged, grouped and plain multi-head attention, left padding, a head_dim that is no
power of two). On the CPU it runs in Triton's interpreter; on a GPU, compiled, and then inside
captured generation, where the completions equal the general path's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# (rows, heads, kv_heads, head_dim, length, dtype): shares of 1 (final) and several (merged),
# head_dim 8-256, groups of 1-64 query heads, 2-600 columns, 70 rows
CASES = [(1, 8, 2, 16, 300, torch.float32), (1, 8, 2, 16, 40, torch.float32),
         (3, 4, 4, 12, 70, torch.float32), (2, 8, 1, 32, 9, torch.bfloat16),
         (5, 4, 2, 16, 130, torch.float16), (4, 6, 2, 64, 200, torch.bfloat16),
         (1, 32, 8, 64, 256, torch.float16), (2, 40, 2, 128, 100, torch.float16),
         (1, 2, 1, 256, 40, torch.float32), (2, 4, 4, 8, 2, torch.float32),
         (1, 64, 1, 16, 600, torch.float16), (70, 2, 2, 16, 33, torch.float32)]


def patch_interpreter() -> None:
    """triton 3.6's interpreter reads a loop bound with int() of a one-element array, which
    numpy 2 refuses; read its one element instead (the interpreter only, for this test)."""
    import numpy as np
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def compare(device: str) -> list[str]:
    """Each case through the kernel and through the general path; the failures, as lines.
    The interpreter multiplies bfloat16 tiles as integers (numpy has no bfloat16): those cases
    run on the GPU only."""
    from graphrun.generate import kv_cache
    from graphrun.generate.decode_attention import decode_attend, usable

    failures = []
    gen = torch.Generator().manual_seed(0)
    for b, heads, kv_heads, dim, length, dtype in CASES:
        if device == "cpu" and dtype == torch.bfloat16:
            continue
        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        cache_k, cache_v = rand(b + 1, kv_heads, length + 8, dim), rand(b + 1, kv_heads,
                                                                      length + 8, dim)
        q = rand(b, 1, heads, dim).transpose(1, 2)  # [b, heads, 1, d], strided as a model's
        k, v = rand(b, 1, kv_heads, dim).transpose(1, 2), rand(b, 1, kv_heads, dim).transpose(1, 2)
        start = torch.randint(0, max(1, length // 2), (b,), generator=gen).to(device)
        col = torch.randint(length // 2, length, (b,), generator=gen).to(device)
        cols = torch.arange(length, device=device)
        seen = (cols[None] >= start[:, None]) & (cols[None] <= col[:, None])
        mask = seen[:, None, None, :]
        if not usable(q):
            return [f"usable() is False for {q.dtype} on {device}"]
        kk, vv = cache_k.clone(), cache_v.clone()
        got = decode_attend(kk[:b], vv[:b], q, k, v, mask, col, None)
        rk, rv = cache_k.float(), cache_v.float()  # the general path, in float32
        want = kv_cache.general_attend(rk, rv, q.float(), k.float(), v.float(), mask,
                                            col, None)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        err = (got.float() - want).abs().max().item()
        name = f"{(b, heads, kv_heads, dim, length, str(dtype))}"
        if got.shape != want.shape or err > tol:
            failures.append(f"{name}: output {tuple(got.shape)}, error {err:.2e} > {tol}")
        if not (torch.equal(kk.float(), rk.to(dtype).float())
                and torch.equal(vv.float(), rv.to(dtype).float())):
            failures.append(f"{name}: the cache after the step differs")
    return failures


def test_the_kernel_in_the_interpreter_equals_the_general_path():
    pytest.importorskip("triton", reason="the decode-attention kernel is written in Triton")
    code = ("import tests.test_decode_attention as t; t.patch_interpreter(); "
            "import sys; f = t.compare('cpu'); print('\\n'.join(f)); sys.exit(1 if f else 0)")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]


def test_outside_the_interpreter_the_cpu_takes_the_general_path():
    from graphrun.generate.decode_attention import usable

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    assert not usable(torch.zeros(1, 4, 1, 16))


@pytest.mark.cuda
def test_the_kernel_on_the_gpu_equals_the_general_path():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton", reason="the decode-attention kernel is written in Triton")
    assert compare("cuda") == []


@pytest.mark.cuda
def test_captured_generation_with_the_kernel_gives_the_general_paths_completions(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton", reason="the decode-attention kernel is written in Triton")
    from graphrun.generate import kv_cache
    from graphrun.generate.config import GenerateConfig
    from graphrun.generate.generator import build_generator
    from graphrun.generate.llama import build_llama

    prompts = [[5 + (7 * i + j) % 500 for j in range(3 + 11 * i)] for i in range(5)]

    def complete():
        model = build_llama(layers=2, d_model=64, heads=8, kv_heads=2, vocab=512, seed=3,
                            device="cuda", dtype=torch.float32)
        gen = build_generator(model, GenerateConfig(max_new_tokens=24), batch_buckets=[1, 8],
                              prompt_buckets=[16, 64], device="cuda", dtype=torch.float32)
        out = [gen.generate(prompts, list(range(5))), gen.generate(prompts[:1], [0])]
        assert all(e["status"] == "captured" for e in gen.buckets()), gen.buckets()
        return [[c.token_ids for c in r.completions] for r in out]

    from graphrun.generate.decode_attention import runs_on

    assert runs_on(torch.device("cuda"), torch.float32, 8)  # what the manifest will say
    with_kernel = complete()
    monkeypatch.setattr(kv_cache, "usable", lambda q: False)
    assert complete() == with_kernel


def test_a_kernel_that_fails_leaves_the_general_path_and_says_so_once(monkeypatch):
    """A GPU or Triton the kernel cannot run on: the step still attends (the general path's
    answer), the kernel is not tried again, and the graph table names the failure once."""
    from graphrun.generate import decode_attention
    from graphrun.generate import kv_cache

    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("no kernel image for this GPU\nsecond line")

    monkeypatch.setattr(decode_attention, "_failures", [])
    monkeypatch.setattr(kv_cache, "usable", lambda q: not decode_attention._failures)
    monkeypatch.setattr(kv_cache, "decode_attend", broken)
    gen = torch.Generator().manual_seed(1)
    ck, cv = torch.randn(2, 2, 8, 4, generator=gen), torch.randn(2, 2, 8, 4, generator=gen)
    q, k, v = (torch.randn(2, h, 1, 4, generator=gen) for h in (4, 2, 2))
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    col = torch.tensor([3, 5])
    want = kv_cache.general_attend(ck.clone(), cv.clone(), q, k, v, mask, col, None)
    for _ in range(2):
        got = kv_cache._attend(ck.clone(), cv.clone(), q, k, v, mask, col, None)
        assert torch.allclose(got, want)
    assert len(calls) == 1 and decode_attention.failure() == "RuntimeError: no kernel image for this GPU"

    from graphrun.generate.config import GenerateConfig
    from graphrun.generate.generator import build_generator
    from graphrun.generate.llama import build_llama

    lines = []
    g = build_generator(build_llama(), GenerateConfig(max_new_tokens=3), batch_buckets=[1],
                        prompt_buckets=[8], log=lines.append)
    g.generate([[5, 6, 7]], [0])
    said = [line for line in lines if "decode attention kernel failed" in line]
    assert len(said) == 1 and "no kernel image for this GPU" in said[0]
    assert sum("decode attention kernel failed" in (e["reason"] or "")
               for e in g.buckets()) == 1
