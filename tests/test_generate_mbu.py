"""generation.mbu's arithmetic on stand-in numbers: the peak by GPU name, the bytes decode
reads (weights per step, each real row's KV columns), and None where it cannot be known."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from graphrun.generate.mbu import decode_bytes, kv_bytes_per_token, mbu, peak_bandwidth


def batch(steps: int, decode_s: float, prompts: list[int]):
    return NS(decode_steps=steps, decode_s=decode_s,
              completions=[NS(prompt_tokens=n) for n in prompts])


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200", 4.8e12), ("NVIDIA H100 80GB HBM3", 3.35e12),
    ("NVIDIA A100-SXM4-80GB", 2.0e12), ("NVIDIA A100 80GB PCIe", 2.0e12),
    ("NVIDIA H100 PCIe", None), ("NVIDIA GeForce RTX 4090", None), ("", None)])
def test_the_peak_bandwidth_comes_from_the_gpus_name(name, peak):
    assert peak_bandwidth(name) == peak


def test_a_tokens_kv_is_keys_and_values_of_every_layer():
    # 32 layers, 8 KV heads of 128, bfloat16: 2 * 32 * 8 * 128 * 2
    assert kv_bytes_per_token(32, 8, 128, 2) == 131072


def test_decode_reads_the_weights_each_step_and_each_rows_growing_context():
    # 3 steps; rows with prompts of 10 and 4 tokens attend over 11, 12, 13 and 5, 6, 7 columns
    results = [batch(3, 0.5, [10, 4])]
    assert decode_bytes(results, param_bytes=1000, kv_token_bytes=2) == (
        3 * 1000 + 2 * (11 + 12 + 13) + 2 * (5 + 6 + 7))


def test_mbu_is_bytes_over_decode_time_over_the_peak():
    results = [batch(3, 0.5, [10, 4]), batch(1, 0.5, [6])]
    read = 3 * 1000 + 2 * 36 + 2 * 18 + 1000 + 2 * 7
    assert mbu(results, param_bytes=1000, kv_token_bytes=2, peak=1e4) == pytest.approx(
        read / 1.0 / 1e4)
    # a 16 GB model decoding 100 steps of one row at 4 ms a step on an H200
    one = [batch(100, 0.4, [1])]
    assert mbu(one, param_bytes=16 * 10**9, kv_token_bytes=0, peak=4.8e12) == pytest.approx(
        16e9 * 100 / 0.4 / 4.8e12)


def test_mbu_is_unknown_without_a_peak_or_a_timed_decode_step():
    assert mbu([batch(3, 0.5, [4])], param_bytes=1, kv_token_bytes=1, peak=None) is None
    assert mbu([batch(0, 0.0, [4])], param_bytes=1, kv_token_bytes=1, peak=4.8e12) is None
    assert mbu([], param_bytes=1, kv_token_bytes=1, peak=4.8e12) is None


def test_a_cpu_generation_job_has_no_mbu_and_the_general_attention(tmp_path):
    import graphrun
    from tests.test_generate_job import write_spec

    spec = write_spec(tmp_path, n=2, generate={"max_new_tokens": 3,
                                               "sampling": {"method": "greedy"}})
    manifest = graphrun.run(graphrun.load_spec(spec))
    assert manifest.generation.mbu is None and manifest.generation.decode_steps > 0
    assert manifest.generation.decode_attention == "general"  # the kernel runs on a GPU


def test_merged_workers_say_each_attention_their_decode_steps_ran():
    from graphrun.manifest.sections import generation_summary, merged_generation

    def section(attention):
        return generation_summary([], (50,), kv_cache_bytes=0, decode_attention=attention)

    assert merged_generation([section("kernel"), section("kernel")]).decode_attention == \
        "kernel"
    assert merged_generation([section("kernel"), section("general")]).decode_attention == \
        "general, kernel"
    assert merged_generation([section(None)]).decode_attention is None


def test_a_step_reads_an_untied_embedding_only_by_rows_a_tied_one_whole():
    from graphrun.generate.llama import build_llama
    from graphrun.generate.mbu import weight_bytes_per_step

    untied = build_llama(layers=1, d_model=16, heads=2, vocab=100, ffn=32)
    every = sum(p.numel() * 4 for p in untied.parameters())
    assert weight_bytes_per_step(untied) == every - 100 * 16 * 4  # less the embedding table
    untied.lm_head.weight = untied.model.embed_tokens.weight  # tied: one tensor, multiplied
    assert weight_bytes_per_step(untied) == every - 100 * 16 * 4
