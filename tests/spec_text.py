"""Tests' spec texts: an edit that must match, and the SpecError a broken spec raises."""

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
