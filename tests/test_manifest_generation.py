"""The manifest's generation section: optional, typed, and in the generated schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from graphrun.manifest import Manifest
from graphrun.manifest_sections import Generation, GraphSetup

ROOT = Path(__file__).resolve().parents[1]


def generation(**change) -> Generation:
    values = dict(
        records=3, prompt_tokens=40, output_tokens=20, finish_reasons={"eos": 1, "length": 2},
        output_tokens_per_s=100.0, prefill_s=0.05, decode_s=0.15,
        ttft_ms={"p50": 4.0, "p90": 5.0, "p99": 6.0}, tpot_ms={"p50": 1.0, "p90": 1.2, "p99": 2.0},
        decode_steps=6, decode_row_steps=24, useful_steps=17, wasted_fraction=1 - 17 / 24,
        kv_cache_bytes=65536,
        graphs=[GraphSetup(kind="prefill", batch=4, length=32, status="captured", capture_s=0.1,
                           memory_bytes=4096),
                GraphSetup(kind="decode", batch=4, length=64, status="eager", reason="cpu")],
        prompts_truncated=1)
    values.update(change)
    return Generation(**values)


def test_manifest_schema_describes_the_generation_section():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "schemas" / "manifest.schema.json").read_text())
    section = schema["$defs"]["Generation"]
    assert {"ttft_ms", "tpot_ms", "decode_steps", "decode_row_steps", "useful_steps",
            "kv_cache_bytes", "graphs",
            "mbu", "prompts_truncated", "prompts_rejected"} <= set(section["properties"])
    doc = json.loads(generation().model_dump_json())
    only = {"$schema": schema["$schema"], "$defs": schema["$defs"], "$ref": "#/$defs/Generation"}
    jsonschema.validate(doc, only)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**doc, "graphs": [{"kind": "prefill"}]}, only)
    assert doc["mbu"] is None and doc["prompts_rejected"] == 0
    assert [g["kind"] for g in doc["graphs"]] == ["prefill", "decode"]


def test_generation_is_optional_in_a_manifest():
    assert Manifest.model_fields["generation"].is_required() is False
    assert Manifest.model_fields["generation"].default is None


@pytest.mark.parametrize("bad", [{"graphs": [{"kind": "verify", "batch": 1, "length": 8,
                                              "status": "captured"}]},
                                 {"unknown": 1}])
def test_generation_refuses_unknown_kinds_and_keys(bad):
    with pytest.raises(ValidationError):
        generation(**bad)
