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
        graphs=[GraphSetup(kind="prefill", size=32, status="captured", capture_s=0.1,
                           memory_bytes=4096),
                GraphSetup(kind="decode", size=4, status="eager", reason="cpu")],
        prompts_truncated=1)
    values.update(change)
    return Generation(**values)


def test_manifest_schema_describes_the_generation_section():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "schemas" / "manifest.schema.json").read_text())
    section = schema["$defs"]["Generation"]
    assert {"ttft_ms", "tpot_ms", "decode_steps", "decode_row_steps", "useful_steps",
            "kv_cache_bytes", "graphs", "slots", "slot_occupancy", "kv_blocks_mean",
            "kv_blocks_peak",
            "mbu", "prompts_truncated", "prompts_rejected"} <= set(section["properties"])
    doc = json.loads(generation().model_dump_json())
    only = {"$schema": schema["$schema"], "$defs": schema["$defs"], "$ref": "#/$defs/Generation"}
    jsonschema.validate(doc, only)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**doc, "graphs": [{"kind": "prefill"}]}, only)
    assert doc["mbu"] is None and doc["prompts_rejected"] == 0
    assert [g["kind"] for g in doc["graphs"]] == ["prefill", "decode"]


def test_prompts_rejected_is_described_as_what_it_counts():
    """generation.prompts_rejected is the run's rejects whatever their reason (a bad value, a
    bad line, a prompt too long), as totals.records_rejected: not only the prompts too long."""
    schema = json.loads((ROOT / "schemas" / "manifest.schema.json").read_text())
    said = schema["$defs"]["Generation"]["properties"]["prompts_rejected"]["description"]
    assert said == Generation.model_fields["prompts_rejected"].description
    assert "whatever the reason" in said and "totals.records_rejected" in said


def test_generation_is_optional_in_a_manifest():
    assert Manifest.model_fields["generation"].is_required() is False
    assert Manifest.model_fields["generation"].default is None


@pytest.mark.parametrize("bad", [{"graphs": [{"kind": "verify", "size": 8,
                                              "status": "captured"}]},
                                 {"unknown": 1}])
def test_generation_refuses_unknown_kinds_and_keys(bad):
    with pytest.raises(ValidationError):
        generation(**bad)


def stats(records=(), steps=(), host_bound=0, prefill_s=0.1, decode_s=0.3):
    """GenerationStats after finishing `records` ((prompt, output tokens, reason)) and decode
    `steps` ((rows, occupied, blocks, keys))."""
    from graphrun.generate.stats import GenerationStats

    s = GenerationStats(host_bound_steps=host_bound, prefill_s=prefill_s, decode_s=decode_s)
    for prompt, output, reason in records:
        s.finished(prompt, output, reason)
    for step in steps:
        s.stepped(*step)
    return s


def summary(s, **kw):
    from graphrun.manifest.sections import generation_summary

    return generation_summary(s, [50, 99], slots=4, kv_block_size=16, kv_blocks=9,
                              kv_cache_bytes=1024, **kw)


def test_the_summary_adds_up_the_engines_sums():
    s = stats([(10, 4, "length"), (10, 2, "eos"), (10, 1, "eos")],
              [(4, 2, 3, 20), (4, 2, 5, 22), (2, 1, 2, 11)])
    for seconds in (0.1, 0.2, 0.3):
        s.ttft.add(seconds)
    g = summary(s, prompts_rejected=2)
    assert (g.records, g.prompt_tokens, g.output_tokens) == (3, 30, 7)
    assert g.finish_reasons == {"length": 1, "eos": 2}
    assert g.output_tokens_per_s == pytest.approx(7 / 0.4)
    assert (g.decode_steps, g.decode_row_steps, g.useful_steps) == (3, 10, 4)
    assert g.wasted_fraction == pytest.approx(1 - 4 / 10)
    assert g.slot_occupancy == pytest.approx(5 / 12)
    assert (g.kv_blocks_mean, g.kv_blocks_peak, g.kv_blocks) == (pytest.approx(10 / 3), 5, 9)
    assert g.ttft_ms["p50"] == pytest.approx(200.0, rel=0.01) and set(g.ttft_ms) == {"p50",
                                                                                    "p99"}
    assert g.tpot_ms == {}  # none added
    assert (g.kv_cache_bytes, g.prompts_rejected, g.mbu) == (1024, 2, None)


def test_a_sketchs_percentiles_are_within_a_percent_in_fixed_memory():
    import numpy as np

    from graphrun.generate.stats import Sketch

    sketch, values = Sketch(), np.random.default_rng(0).lognormal(-5, 1, 20000)
    for v in values:
        sketch.add(float(v))
    got = sketch.percentiles([50, 90, 99])
    for p in (50, 90, 99):
        assert got[f"p{p}"] == pytest.approx(np.percentile(values, p) * 1e3, rel=0.011)
    assert sketch.counts.nbytes < 1 << 15


def test_steps_the_device_waited_on_the_host_are_added_up_and_named_in_the_summary():
    from graphrun.job.progress import generation_line
    from graphrun.manifest.sections import merged_generation

    steps = [(1, 1, 1, 5)] * 3
    gpu = summary(stats([(5, 4, "length")] * 2, steps * 2, host_bound=2))
    cpu = summary(stats([(5, 4, "length")] * 2, steps * 2, host_bound=None))
    assert (gpu.host_bound_steps, cpu.host_bound_steps) == (2, None)
    assert generation_line(gpu).endswith("; the device waited on the host at 2 of 6 decode "
                                         "steps")
    ahead = summary(stats([(5, 4, "length")], steps, host_bound=0))
    assert "waited" not in generation_line(ahead) and "waited" not in generation_line(cpu)
    assert merged_generation([gpu, ahead]).host_bound_steps == 2
    assert merged_generation([cpu, cpu]).host_bound_steps is None
    doc = json.loads(gpu.model_dump_json())
    assert doc["host_bound_steps"] == 2


def test_on_the_cpu_no_step_is_counted_as_waited_for():
    import torch

    from graphrun.generate import Engine, GenerateConfig, build_llama

    model = build_llama(layers=1, d_model=32, heads=4, kv_heads=2, vocab=64, max_len=32)
    gen = Engine(model, config=GenerateConfig(max_new_tokens=4), slots=2, max_prompt=8,
                 device="cpu", dtype=torch.float32, backend="eager")
    try:
        gen.generate([[3, 4], [5]], ["a", "b"])
    finally:
        gen.close()
    assert gen.stats.decode_steps == 3 and gen.stats.host_bound_steps is None
