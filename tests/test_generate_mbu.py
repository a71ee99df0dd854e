"""generation.mbu's arithmetic on stand-in numbers: the peak by GPU name, the bytes decode
reads (weights per step, each real row's KV columns), and None where it cannot be known."""

from __future__ import annotations


import pytest

from graphrun.generate.mbu import kv_bytes_per_token, peak_bandwidth


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200", 4.8e12), ("NVIDIA H100 80GB HBM3", 3.35e12),
    ("NVIDIA A100-SXM4-80GB", 2.0e12), ("NVIDIA A100 80GB PCIe", 2.0e12),
    ("NVIDIA H100 PCIe", None), ("NVIDIA GeForce RTX 4090", None), ("", None)])
def test_the_peak_bandwidth_comes_from_the_gpus_name(name, peak):
    assert peak_bandwidth(name) == peak


def test_a_tokens_kv_is_keys_and_values_of_every_layer():
    # 32 layers, 8 KV heads of 128, bfloat16: 2 * 32 * 8 * 128 * 2
    assert kv_bytes_per_token(32, 8, 128, 2) == 131072


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
        from graphrun.generate.stats import GenerationStats

        return generation_summary(GenerationStats(), (50,), slots=1, kv_block_size=16,
                                  kv_blocks=2, kv_cache_bytes=0, decode_attention=attention)

    assert merged_generation([section("kernel"), section("kernel")]).decode_attention == \
        "kernel"
    assert merged_generation([section("kernel"), section("general")]).decode_attention == \
        "general, kernel"
    assert merged_generation([section(None)]).decode_attention is None


def test_a_step_reads_an_untied_embedding_only_by_rows_a_tied_one_whole():
    from graphrun.models.causal.llama import build_llama
    from graphrun.generate.mbu import weight_bytes_per_step

    untied = build_llama(layers=1, d_model=16, heads=2, vocab=100, ffn=32)
    every = sum(p.numel() * 4 for p in untied.parameters())
    assert weight_bytes_per_step(untied) == every - 100 * 16 * 4  # less the embedding table
    untied.lm_head.weight = untied.model.embed_tokens.weight  # tied: one tensor, multiplied
    assert weight_bytes_per_step(untied) == every - 100 * 16 * 4
