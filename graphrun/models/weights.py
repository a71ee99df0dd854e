"""Whether saved tensors are the model's: the check every way of loading weights makes before
any work (graphrun's own Llama, GPT-2 and BERT, transformers' classes, model.weights).

A model run with a tensor left at its random init, with a saved tensor dropped, or with
integers read as floats gives wrong outputs that look right, so each is one error naming the
tensors: missing, unexpected, of another shape, of another kind of dtype (floating, integer,
bool). A missing tensor is allowed only where the spec's model.allow_missing names it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from graphrun.base.errors import ModelError

SHOWN = 4  # tensors named per kind of mismatch; the rest are counted
ALLOW_KEY = "model.allow_missing"


@dataclass(frozen=True)
class Held:
    """One tensor as saved or as the model holds it: its shape and dtype's name."""

    shape: tuple[int, ...]
    dtype: str  # a safetensors header's (F32, I32, BF16, BOOL) or torch's (torch.float32)

    @property
    def kind(self) -> str:
        """f (floating), i (integer), b (bool), c (complex): a cast within a kind is a load's
        usual cast to model.dtype, across kinds it is another tensor's bytes."""
        d = self.dtype.removeprefix("torch.").upper()
        if d == "BOOL":
            return "b"
        if d.startswith(("C", "COMPLEX")):
            return "c"
        return "f" if d.startswith(("F", "BF", "HALF", "DOUBLE")) else "i"


def held(tensors: Mapping[str, Any]) -> dict[str, Held]:
    """torch tensors (meta ones too) by name, as Held."""
    return {n: Held(tuple(t.shape), str(t.dtype)) for n, t in tensors.items()}


@dataclass
class Mismatch:
    """How saved tensors differ from the model's; empty where they are the model's."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    reshaped: list[str] = field(default_factory=list)  # "name: saved [a, b], model [c, d]"
    retyped: list[str] = field(default_factory=list)  # "name: saved I32, model torch.float32"

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.reshaped or self.retyped)

    def describe(self) -> str:
        parts = []
        for what, items in (("missing", self.missing), ("unexpected", self.unexpected),
                            ("of another shape", self.reshaped),
                            ("of another kind of dtype", self.retyped)):
            if items:
                more = f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
                parts.append(f"{len(items)} {what} ({'; '.join(items[:SHOWN])}{more})")
        return "; ".join(parts)


def allowed(name: str, allow_missing: Iterable[str]) -> bool:
    """Whether model.allow_missing (names or globs) names this tensor."""
    return any(fnmatchcase(name, pattern) for pattern in allow_missing)


def compare(want: Mapping[str, Held], saved: Mapping[str, Held],
            allow_missing: Iterable[str] = ()) -> Mismatch:
    """The model's tensors (want) against the saved ones, by name."""
    allow_missing = tuple(allow_missing)
    found = Mismatch(
        missing=sorted(n for n in set(want) - set(saved) if not allowed(n, allow_missing)),
        unexpected=sorted(set(saved) - set(want)))
    for name in sorted(set(want) & set(saved)):
        w, s = want[name], saved[name]
        if w.shape != s.shape:
            found.reshaped.append(f"{name}: saved {list(s.shape)}, model {list(w.shape)}")
        if w.kind != s.kind:
            found.retyped.append(f"{name}: saved {s.dtype}, model {w.dtype}")
    return found


def weights_error(where: str, found: Mismatch, remedy: str) -> ModelError:
    """One error naming the tensors that differ, where they were read and what to do."""
    missing = (f"; where the job does not use a missing tensor, name it in {ALLOW_KEY} "
               "(it keeps its initial values)" if found.missing else "")
    return ModelError(f"{where}: the saved weights are not the model's: {found.describe()}; "
                      f"{remedy}{missing}")
