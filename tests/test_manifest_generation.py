"""The manifest's generation section: optional, typed, and in the generated schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from graphrun.manifest.keys import Manifest
from graphrun.manifest.sections import Generation, GraphSetup

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


def test_the_summary_adds_up_the_batches():
    from types import SimpleNamespace as NS

    from graphrun.manifest.sections import generation_summary

    def done(tokens, reason):
        return NS(token_ids=[0] * tokens, finish_reason=reason, prompt_tokens=10,
                  output_tokens=tokens)

    # batch 1: 2 rows in a 4-row graph, 3 decode steps; batch 2: 1 row, 1 token (no decode)
    results = [NS(completions=[done(4, "length"), done(2, "eos")], prefill_s=0.1, decode_s=0.3,
                  ttft_s=0.1, decode_steps=3, useful_steps=4, rows=4, bucket=(4, 16)),
               NS(completions=[done(1, "eos")], prefill_s=0.1, decode_s=0.0, ttft_s=0.2,
                  decode_steps=0, useful_steps=0, rows=0, bucket=(1, 16))]
    g = generation_summary(results, [50, 99], kv_cache_bytes=1024, prompts_rejected=2)
    assert (g.records, g.prompt_tokens, g.output_tokens) == (3, 30, 7)
    assert g.finish_reasons == {"length": 1, "eos": 2}
    assert g.output_tokens_per_s == pytest.approx(7 / 0.5)
    assert (g.decode_steps, g.decode_row_steps, g.useful_steps) == (3, 12, 4)
    assert g.wasted_fraction == pytest.approx(1 - 4 / 12)
    assert g.ttft_ms["p50"] == pytest.approx(100.0) and set(g.ttft_ms) == {"p50", "p99"}
    assert g.tpot_ms == {"p50": pytest.approx(100.0), "p99": pytest.approx(100.0)}
    assert (g.kv_cache_bytes, g.prompts_rejected, g.mbu) == (1024, 2, None)


def test_steps_the_device_waited_on_the_host_are_added_up_and_named_in_the_summary():
    from types import SimpleNamespace as NS

    from graphrun.job.progress import generation_line
    from graphrun.manifest.sections import generation_summary, merged_generation

    def batch(host_bound):
        return NS(completions=[NS(token_ids=[0] * 4, finish_reason="length", prompt_tokens=5,
                                  output_tokens=4)], prefill_s=0.1, decode_s=0.3, ttft_s=0.1,
                  decode_steps=3, useful_steps=3, rows=1, bucket=(1, 8),
                  host_bound_steps=host_bound)

    gpu = generation_summary([batch(2), batch(0)], [50], kv_cache_bytes=0)
    cpu = generation_summary([batch(None), batch(None)], [50], kv_cache_bytes=0)
    assert (gpu.host_bound_steps, cpu.host_bound_steps) == (2, None)
    assert generation_line(gpu).endswith("; the device waited on the host at 2 of 6 decode "
                                         "steps")
    ahead = generation_summary([batch(0)], [50], kv_cache_bytes=0)
    assert "waited" not in generation_line(ahead) and "waited" not in generation_line(cpu)
    assert merged_generation([gpu, ahead]).host_bound_steps == 2
    assert merged_generation([cpu, cpu]).host_bound_steps is None
    doc = json.loads(gpu.model_dump_json())
    assert doc["host_bound_steps"] == 2


def test_on_the_cpu_no_step_is_counted_as_waited_for():
    import torch

    from graphrun.generate import GenerateConfig, Generator, build_llama

    model = build_llama(layers=1, d_model=32, heads=4, kv_heads=2, vocab=64, max_len=32)
    gen = Generator(model, config=GenerateConfig(max_new_tokens=4), batch_buckets=[2],
                    prompt_buckets=[8], device="cpu", dtype=torch.float32, backend="eager")
    try:
        result = gen.generate([[3, 4], [5]], ["a", "b"])
    finally:
        gen.close()
    assert result.decode_steps == 3 and result.host_bound_steps is None
