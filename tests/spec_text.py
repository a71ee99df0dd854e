"""Tests' spec texts: a tiny MLP's, an edit that must match, and the SpecError a broken spec
raises."""

from __future__ import annotations

import pytest


def edited(text: str, old: str, new: str) -> str:
    """text with old replaced by new; old must be in it (an edit that matched nothing would
    test the spec unbroken)."""
    assert old in text, old
    return text.replace(old, new)


def spec_error(path, overrides=()):
    """The SpecError that load_spec(path, overrides) must raise."""
    from graphrun import SpecError, load_spec

    with pytest.raises(SpecError) as info:
        load_spec(path, list(overrides))
    return info.value


def problems(path, overrides=()) -> list[str]:
    """Each problem of that SpecError, as it prints."""
    return [str(p) for p in spec_error(path, overrides).problems]


def mlp_spec(name: str, **data) -> str:
    """The text of a CPU spec of a tiny builtin MLP (x: 2 floats in, scores: 2 out, batch
    buckets 1 and 4); data: the data section's keys (path, batch_size, ...)."""
    section = ", ".join(f"{key}: {value}" for key, value in data.items())
    return f"""\
version: 1
name: {name}
device: cpu
model: {{builtin: mlp, args: {{in_features: 2, hidden: 4, layers: 1, out_features: 2}}}}
inputs:
  x: {{shape: [batch, 2], dtype: float32}}
outputs:
  scores: {{shape: [batch, 2]}}
buckets: {{batch: [1, 4]}}
data: {{{section}}}
output: {{dir: out}}
"""
