"""The field types every section of the spec shares (spec.py, spec_generate.py)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# Sizes are strict integers: YAML's `true` or `1e30` is no size.
Size = Annotated[int, Field(strict=True, gt=0, le=2**31 - 1)]


class Strict(BaseModel):
    """Unknown keys are errors at every depth."""

    model_config = ConfigDict(extra="forbid", validate_default=True)
