"""Shared prompt prefixes computed once (the engine's prefix cache, CPU, fp32, tiny seeded
models): completions equal with the cache on and off, greedy and seeded sampling; the shared
blocks are prefilled once and counted; a small pool evicts idle cached blocks and the outputs
stay equal; every reference is given back."""

from __future__ import annotations

import copy
from collections import deque

import pytest

pytest.importorskip("transformers")

from graphrun.generate.config import GenerateConfig, Sampling  # noqa: E402
from graphrun.generate.engine import Request, build_engine  # noqa: E402
from graphrun.models.causal.kv_cache import BlockPool, chain_hashes  # noqa: E402
from graphrun.models.causal.llama import build_llama  # noqa: E402
from tests.generate_models import tiny_gpt2, tiny_llama  # noqa: E402

BS = 4
SYSTEM = [(7 * i + 3) % 90 + 3 for i in range(40)]  # 10 full blocks
# 16 user parts of 3 to 10 tokens, each starting with its own token (no longer shared prefix)
USERS = [[60 + i] + [(5 * i + j) % 50 + 3 for j in range(2 + i % 8)] for i in range(16)]
PROMPTS = [SYSTEM + u for u in USERS]
GREEDY = GenerateConfig(max_new_tokens=8, eos_ids=(2,))
SAMPLED = GenerateConfig(max_new_tokens=8, eos_ids=(2, 5, 7),
                         sampling=Sampling(method="sample", temperature=3.0, top_k=60,
                                           top_p=0.95, seed=7))


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def engine(model, config, *, slots=4, **kwargs):
    return build_engine(copy.deepcopy(model), config, slots=slots, max_prompt=64,
                        block_size=BS, **kwargs)


def tokens(completions):
    return [c.token_ids for c in completions]


def all_given_back(eng) -> bool:
    return (all(eng.blocks.refs(b) == 0 for b in range(eng.num_blocks))
            and eng.blocks.free == eng.num_blocks - 1)


def own_llama():
    return build_llama(layers=2, d_model=64, heads=4, kv_heads=2, vocab=96, max_len=128)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2, own_llama],
                         ids=["llama", "gpt2", "own-llama"])
def test_greedy_completions_equal_with_the_prefix_cache_on_and_off(make):
    model = make()
    on, off = engine(model, GREEDY), engine(model, GREEDY, prefix_cache=False)
    got = on.generate(PROMPTS)
    assert tokens(got) == tokens(off.generate(PROMPTS))
    assert len({tuple(t) for t in tokens(got)}) > 4  # the completions differ between records


def test_the_shared_system_prompt_is_prefilled_once_and_counted(llama):
    on, off = engine(llama, GREEDY), engine(llama, GREEDY, prefix_cache=False)
    on.generate(PROMPTS)
    off.generate(PROMPTS)
    total = sum(map(len, PROMPTS))
    # the first prompt computes the system prompt's 10 blocks; the 15 others share them
    assert on.stats.prompt_reused == 15 * len(SYSTEM)
    assert on.stats.prompt_computed == total - 15 * len(SYSTEM)
    assert (off.stats.prompt_computed, off.stats.prompt_reused) == (total, 0)
    assert on.stats.prompt_tokens == off.stats.prompt_tokens == total


def test_seeded_sampling_is_the_same_with_the_prefix_cache_on_and_off(llama):
    on, off = engine(llama, SAMPLED), engine(llama, SAMPLED, prefix_cache=False)
    assert tokens(on.generate(PROMPTS)) == tokens(off.generate(PROMPTS))
    assert on.stats.prompt_reused > 0


def test_penalties_count_the_shared_prompt_tokens_as_seen(llama):
    # a shared block's tokens are not packed, yet they are the prompt's: the repetition and
    # presence penalties see them as with the cache off
    penalized = GenerateConfig(max_new_tokens=8, eos_ids=(2,), sampling=Sampling(
        method="greedy", repetition_penalty=1.8, presence_penalty=0.5))
    on, off = engine(llama, penalized), engine(llama, penalized, prefix_cache=False)
    assert tokens(on.generate(PROMPTS)) == tokens(off.generate(PROMPTS))
    assert on.stats.prompt_reused == 15 * len(SYSTEM)


def test_prompts_sharing_a_block_the_same_prefill_computes_wait_for_the_next_one(llama):
    # three system prompts, two records each in a row: the first of each computes it in one
    # prefill, the second of each shares it in the next (15 blocks: what one prefill may read)
    systems = [[(k * i + 3) % 90 + 3 for i in range(20)] for k in (7, 11, 13)]
    prompts = [systems[i // 2] + USERS[i] for i in range(6)]
    on = engine(llama, GREEDY, slots=8, prefill_tokens=512)
    got = on.generate(prompts)
    assert tokens(got) == tokens(engine(llama, GREEDY, prefix_cache=False).generate(prompts))
    assert on.stats.prefills == 2 and on.stats.prompt_reused == 3 * 20


def test_a_whole_cached_prompt_still_computes_its_last_token(llama):
    # a prompt of exactly 10 full blocks, run twice: its last block is computed both times
    prompts = [SYSTEM, SYSTEM, SYSTEM[:37]]
    on = engine(llama, GREEDY, slots=1)
    got = on.generate(prompts)
    assert tokens(got) == tokens(engine(llama, GREEDY, prefix_cache=False).generate(prompts))
    assert tokens(got)[0] == tokens(got)[1]
    assert on.stats.prompt_reused == 36 + 36  # 9 blocks each time, never the last one


OTHER = [(11 * i + 5) % 90 + 3 for i in range(40)]
# two system prompts taking turns, two records each
TURNS = [(SYSTEM if (i // 2) % 2 else OTHER) + u for i, u in enumerate(USERS)]


def test_a_small_pool_evicts_idle_cached_blocks_and_outputs_stay_equal(llama):
    # 24 blocks hold one row of 64 + 8 tokens (18 blocks) and a few cached: admitted in input
    # order (no look-ahead), the idle prefix of one is evicted to admit the other
    small, large = (engine(llama, GREEDY, slots=2, num_blocks=n, window=0) for n in (24, None))
    got = small.generate(TURNS)
    assert tokens(got) == tokens(engine(llama, GREEDY, prefix_cache=False).generate(TURNS))
    assert tokens(got) == tokens(large.generate(TURNS))
    # some blocks shared, some evicted before their next use
    assert 0 < small.stats.prompt_reused < large.stats.prompt_reused
    assert all_given_back(small)


def test_admission_takes_prompts_with_a_cached_opening_first_and_computes_less(llama):
    # the job above: looking ahead, the records of the system prompt cached now go first, so
    # each system prompt is computed once although the pool cannot keep both
    ordered, in_order = (engine(llama, GREEDY, slots=2, num_blocks=24, window=w)
                         for w in (8, 0))
    got = ordered.generate(TURNS)
    assert tokens(got) == tokens(engine(llama, GREEDY, prefix_cache=False).generate(TURNS))
    assert tokens(in_order.generate(TURNS)) == tokens(got)
    assert ordered.stats.prompt_reused == 14 * len(SYSTEM)  # all but each one's first
    assert ordered.stats.prompt_computed < in_order.stats.prompt_computed
    assert ordered.stats.prompt_computed == sum(map(len, TURNS)) - 14 * len(SYSTEM)
    assert all_given_back(ordered)


def test_references_return_to_zero_and_the_blocks_stay_cached(llama):
    on = engine(llama, GREEDY)
    on.generate(PROMPTS)
    assert all_given_back(on)
    assert on.blocks.cached >= len(SYSTEM) // BS  # the system prompt's blocks, idle, kept
    again = on.generate(PROMPTS[:2])  # a later job's prompts share them from the start
    assert tokens(again) == tokens(engine(llama, GREEDY, prefix_cache=False)
                                   .generate(PROMPTS[:2]))
    assert on.stats.prompt_reused == 15 * len(SYSTEM) + 2 * len(SYSTEM)


def test_a_prefill_reads_only_the_cached_blocks_its_prompts_share(llama, monkeypatch):
    from graphrun.models.causal import kv_cache

    widths = []  # per layer and prefill: how many cached blocks its attention gathered
    gather = kv_cache.gather_blocks
    # a patch: a spy inside each layer's attention, where no caller can hand one in
    monkeypatch.setattr(kv_cache, "gather_blocks",
                        lambda cache, blocks: widths.append(blocks.shape[0]) or gather(
                            cache, blocks))
    on = engine(llama, GREEDY)
    assert on.prefix_blocks == 15  # what one prefill may read
    on.generate(USERS)  # no two share a block: no prefill reads the cache
    assert widths == [] and on.stats.prompt_reused == 0
    on.generate(PROMPTS)  # the system prompt's 10 blocks, read by the prefills after the first
    assert widths and set(widths) == {len(SYSTEM) // BS}
    assert on.stats.prompt_reused == 15 * len(SYSTEM)
    assert 0 < on.stats.reading_prefills < on.stats.prefills  # not the first one


def test_a_prompt_is_overtaken_by_at_most_the_window(llama):
    # one slot: records finish in the order they are admitted. Record 1 opens with an uncached
    # system prompt, the records after it with the one record 0 leaves cached
    prompts = [SYSTEM + USERS[0], OTHER + USERS[1]] + [SYSTEM + u for u in USERS[2:10]]
    eng = engine(llama, GREEDY, slots=1, window=2)
    source = deque(Request(p, i) for i, p in enumerate(prompts))
    finished = []
    eng.serve(lambda n, block: [source.popleft() for _ in range(min(n, len(source)))] or (
        None if not source else []), lambda f: finished.append(f.request.record_id))
    assert finished[:4] == [0, 2, 3, 1]  # two later records went first, then its turn came
    assert sorted(finished) == list(range(10))


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_gpu_prefills_reading_cached_prefixes_equal_the_cpu_without_sharing(llama):
    graphs = engine(llama, GREEDY, device="cuda")
    assert all(g["status"] == "captured" for g in graphs.graphs()), graphs.graphs()
    got = graphs.generate(PROMPTS)
    assert tokens(got) == tokens(engine(llama, GREEDY, prefix_cache=False).generate(PROMPTS))
    assert graphs.stats.prompt_reused == 15 * len(SYSTEM) and all_given_back(graphs)


def test_a_block_pool_shares_cached_blocks_and_evicts_the_least_recently_used():
    pool = BlockPool(6)
    keys = chain_hashes(list(range(12)), 4, 3)
    a = pool.take(3)
    for block, key in zip(a, keys):
        assert pool.register(block, key)
    assert not pool.register(pool.take(1)[0], keys[0])  # a key names one block
    assert pool.lookup(keys) == a and pool.lookup([keys[0], b"other", keys[2]]) == a[:1]
    pool.share(a[:2])
    assert pool.idle_among(a) == 0 and pool.refs(a[0]) == 2
    pool.give(a)  # the first two still held by their sharer; the third idle, cached
    assert pool.free == 2 and pool.idle_among(a) == 1 and pool.lookup(keys) == a
    taken = pool.take(2)  # the never-registered block first, then the idle one, evicted
    assert taken == [5, a[2]] and pool.lookup(keys) == a[:2]
    with pytest.raises(RuntimeError):
        pool.take(1)  # the held shared blocks are never taken
    assert chain_hashes([1, 2, 3, 4, 5], 4, 1) == chain_hashes([1, 2, 3, 4, 9], 4, 1)
    assert chain_hashes([1, 2, 3, 4], 2, 2)[1] != chain_hashes([9, 2, 3, 4], 2, 2)[1]


def test_a_job_counts_the_reused_prompt_tokens_and_can_turn_the_cache_off(tmp_path):
    import json

    import graphrun
    from graphrun.job.progress import generation_line
    from tests.test_generate_job import completions, write_spec

    system = ("You are a careful assistant. Answer in one short sentence, plainly, and never "
              "make up facts you are not sure of. ") * 3
    runs = {}
    for on in (True, False):
        folder = tmp_path / str(on)
        folder.mkdir()
        spec = write_spec(folder, n=1, generate={"max_new_tokens": 4, "prefix_cache": on})
        with open(folder / "prompts.jsonl", "w") as f:
            for i in range(6):
                f.write(json.dumps({"id": i, "prompt": f"{system}Question {i}: what is {i}?"})
                        + "\n")
        manifest = graphrun.run(graphrun.load_spec(spec))
        runs[on] = completions(folder / "out"), manifest.generation
    (rows_on, on), (rows_off, off) = runs[True], runs[False]
    assert [r["token_ids"] for r in rows_on] == [r["token_ids"] for r in rows_off]
    assert on.prompt_tokens == off.prompt_tokens == off.prompt_tokens_computed
    assert on.prompt_tokens_reused > 0 and off.prompt_tokens_reused == 0
    assert on.prompt_tokens_computed + on.prompt_tokens_reused == on.prompt_tokens
    assert on.prefix_hit_rate == on.prompt_tokens_reused / on.prompt_tokens
    assert f"{on.prompt_tokens_reused:,} reused" in generation_line(on)
    assert "reused" not in generation_line(off)


def test_workers_prefix_counts_add_up_and_the_hit_rate_is_taken_over_all():
    from graphrun.manifest.sections import merged_generation
    from tests.test_manifest_generation import generation

    a = generation(prompt_tokens_computed=30, prompt_tokens_reused=10, prefix_hit_rate=0.25)
    b = generation(prompt_tokens_computed=10, prompt_tokens_reused=50, prefix_hit_rate=5 / 6)
    merged = merged_generation([a, b])
    assert (merged.prompt_tokens_computed, merged.prompt_tokens_reused) == (40, 60)
    assert merged.prefix_hit_rate == pytest.approx(0.6)
