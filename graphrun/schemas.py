"""JSON schemas generated from the pydantic models (never edited by hand)."""

from __future__ import annotations

import json
from pathlib import Path

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"
DIALECT = "https://json-schema.org/draft/2020-12/schema"


def build(kind: str) -> dict:
    if kind == "pipeline":
        from .spec import PipelineSpec as model

        title = "graphrun pipeline spec, version 1"
    else:
        from .manifest import Manifest as model

        title = "graphrun run manifest, version 1"
    schema = model.model_json_schema()
    schema["title"] = title
    return {"$schema": DIALECT, "$id": f"{kind}.schema.json", **schema}


def render(kind: str) -> str:
    return json.dumps(build(kind), indent=2, sort_keys=False) + "\n"


def path_of(kind: str) -> Path:
    return SCHEMA_DIR / f"{kind}.schema.json"
