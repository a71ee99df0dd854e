"""The field types every section of the spec shares (keys.py, generate.py)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

# Sizes are strict integers: YAML's `true`, `'64'` or `1e30` is no size.
Size = Annotated[int, Field(strict=True, gt=0, le=2**31 - 1)]
Whole = Annotated[int, Field(strict=True)]  # a count or a seed: `true` or `'3'` is none
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _printable(value: str) -> str:
    bad = _CONTROL.search(value)
    if bad:
        raise ValueError(f"holds the control character {bad.group()!r} at {bad.start()}; "
                         "names and paths are printable text")
    return value


# a name, key or path as text: strict (YAML's `!!binary` bytes or a number are no name) and
# printable (a NUL would cut it short in a file name, a log line, a C library)
Text = Annotated[str, Field(strict=True), AfterValidator(_printable)]


class Strict(BaseModel):
    """Unknown keys are errors at every depth."""

    model_config = ConfigDict(extra="forbid", validate_default=True)
