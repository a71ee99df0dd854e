"""model.compile for generation: the step model under torch.compile, inside graphrun's capture.

inductor fuses what lies between the attention calls (norms, RoPE, activations, residual adds)
into a few kernels; graphrun's KV cache stays one opaque operator (kv_cache.attend), so the
whole forward is one graph with no break. Shapes are dynamic: one compilation serves every
batch and KV-length bucket of a kind (torch specializes a size of 1 apart), not one per shape
as HF's static cache needs. torch.compile's own CUDA graphs stay off: the graph table captures
the compiled step with its bookkeeping, as it captures the plain one.

A one-row decode step (tokens [1, 1]) is compiled with inductor's coordinate-descent tuning:
with it inductor writes each of the step's matrix-vector products as a tuned reduction kernel
(fused with the norm or activation beside it) instead of a cuBLAS GEMM, whose tiles leave a
one-row product short of the memory bandwidth the step is bound by. The tuning lengthens that
compilation (inductor's on-disk cache serves a later process with the same shapes); other
shapes keep the default.

A compilation that fails, or a compiled step whose outputs disagree with the plain model's, is
not fatal: that graph (and every later one, after a failure) is set up from the plain model,
with the reason in the manifest.
"""

from __future__ import annotations

import torch

from graphrun.models.causal.kv_cache import PagedCache, StepKV

# a compilation per kind and batch regime (prefill, decode; one row or many), and a few spare
RECOMPILE_LIMIT = 16


class CompiledStep:
    """A step model (steps.StepModel) whose calls run torch.compile's kernels; `plain` is the
    model itself, the reference every compiled graph is verified against."""

    def __init__(self, model, cache: PagedCache):
        from graphrun.models.load import allow_recompiles

        allow_recompiles(RECOMPILE_LIMIT)
        for t in (*cache.k, *cache.v):  # their sizes never change: no guard ties them to b
            torch._dynamo.mark_static(t)
        self.plain, self.vocab = model, model.vocab
        self._fn = torch.compile(model, dynamic=True, fullgraph=True,
                                 options={"triton.cudagraphs": False})

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor,
                 kv: StepKV) -> torch.Tensor:
        if tokens.shape == (1, 1):
            # read at compile time only: the [1, 1] specialization is compiled under it
            with torch._inductor.config.patch(coordinate_descent_tuning=True):
                return self._fn(tokens, positions, kv)
        return self._fn(tokens, positions, kv)
