"""The builtin models, one table for both kinds of job: each builtin's builder, the job it serves
(a forward pass per record, or generation) and, for a causal LM, its shape from its arguments
(known before the weights are made: the kernels' warm-up starts on it).

Builders are named, not imported: a forward-pass job never imports the causal LMs' code. The
spec checks builtin names against spec/keys.BUILTIN_JOBS, which a test holds equal to this.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Literal


@dataclass(frozen=True)
class Builtin:
    builder: str | Callable[..., Any]  # "module:function" -> nn.Module, given model.args
    job: Literal["forward", "generate"]
    shape: str | None = None  # "module:function": a causal LM's shape from the same args

    def builder_function(self) -> Callable[..., Any]:
        """The builder itself (its module imported on first use)."""
        return _resolve(self.builder)

    def shape_of(self, args: dict) -> Any:
        return _resolve(self.shape)(**args) if self.shape else None


BUILTINS: dict[str, Builtin] = {
    "mlp": Builtin("graphrun.models.builtin.mlp:build_mlp", "forward"),
    "decoder": Builtin("graphrun.models.builtin.decoder:build_decoder", "forward"),
    "llama": Builtin("graphrun.models.causal.llama:build_llama", "generate",
                     shape="graphrun.models.causal.llama:builtin_shape"),
}


def of_job(job: str) -> list[str]:
    """The builtins' names for one kind of job, in the table's order."""
    return [name for name, b in BUILTINS.items() if b.job == job]


def _resolve(path: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(path):
        return path
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)
