"""The continuous-batching engine on the CPU (fp32, tiny seeded models): completions equal
transformers' greedy generate per record at any slot count, slots are refilled in input order as
records finish, seeded sampling is the same across slot counts and admission orders, KV blocks are
freed and reused, and each record's own parameters are honoured."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")

from graphrun.generate.config import GenerateConfig, GenerationError, Sampling  # noqa: E402
from graphrun.generate.engine import Request, build_engine, decode_sizes  # noqa: E402
from graphrun.models.causal.kv_cache import BlockPool  # noqa: E402
from graphrun.spec.request import RequestParams  # noqa: E402
from tests.generate_models import IDS, PROMPTS, hf_greedy, tiny_gpt2, tiny_llama  # noqa: E402

SAMPLED = GenerateConfig(max_new_tokens=16, eos_ids=(2, 5, 7, 11, 13, 17),
                         sampling=Sampling(method="sample", temperature=3.0, top_k=60,
                                           top_p=0.95, seed=7))


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def engine(model, config, slots, **kwargs):
    kwargs.setdefault("block_size", 4)
    return build_engine(copy.deepcopy(model), config, slots=slots, max_prompt=16, **kwargs)


def tokens(completions):
    return [c.token_ids for c in completions]


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("slots", [1, 2, 8])
def test_greedy_equals_transformers_generate_per_record(make, slots):
    model = make()
    want = hf_greedy(model, PROMPTS, max_new_tokens=12, eos_ids=(2,))
    got = engine(model, GenerateConfig(max_new_tokens=12, eos_ids=(2,)), slots).generate(
        PROMPTS, IDS)
    assert tokens(got) == want
    assert [c.finish_reason for c in got] == ["eos" if w[-1] == 2 and len(w) < 12 else "length"
                                              for w in want]
    assert [c.prompt_tokens for c in got] == [len(p) for p in PROMPTS]


def test_finished_slots_are_refilled_in_input_order(llama):
    # record i stops after i + 1 tokens (its own max_new_tokens): with 2 slots, the record that
    # ends first frees its slot for the next waiting prompt, in input order
    eng = engine(llama, GenerateConfig(max_new_tokens=8), 2)
    order, joined = [], []
    prompts = [[3 + i, 4, 5] for i in range(6)]
    source = [Request(p, i, RequestParams(max_new_tokens=[4, 1, 2, 1, 3, 1][i]))
              for i, p in enumerate(prompts)]

    def take(n, block):
        if not source:
            return None
        got = source[:min(n, 1)]  # one at a time: admissions follow the frees
        del source[:len(got)]
        joined.extend(r.record_id for r in got)
        return got

    eng.serve(take, lambda f: order.append((f.request.record_id, f.completion.output_tokens)))
    assert joined == list(range(6))
    assert sorted(order) == [(i, n) for i, n in enumerate([4, 1, 2, 1, 3, 1])]
    assert order[0][0] == 1  # the one-token record finishes before record 0's four
    assert order[-1][0] in (0, 4)  # the longest records end last
    assert eng.stats.records == 6 and eng.stats.useful_steps == 3 + 0 + 1 + 0 + 2 + 0


def test_seeded_sampling_is_the_same_across_slot_counts_and_admission_orders(llama):
    prompts = [PROMPTS[i % len(PROMPTS)][: 3 + i % 7] + [i] for i in range(12)]
    ids = [f"rec-{i}" for i in range(12)]
    runs = []
    for slots in (1, 3, 8):
        runs.append(tokens(engine(llama, SAMPLED, slots).generate(prompts, ids)))
    back = engine(llama, SAMPLED, 4).generate(prompts[::-1], ids[::-1])
    runs.append(tokens(back)[::-1])
    assert all(run == runs[0] for run in runs[1:])
    lengths = {len(t) for t in runs[0]}
    assert len(lengths) > 2  # ended by the stop ids at varied lengths, some at the cap
    assert any(t[-1] in SAMPLED.eos_ids for t in runs[0]) and 16 in lengths
    other = tokens(engine(llama, SAMPLED, 3).generate(prompts, [f"x-{i}" for i in range(12)]))
    assert other != runs[0]  # the record id is part of its stream


def test_stop_ids_end_records_at_varied_lengths_and_match_transformers(llama):
    want = hf_greedy(llama, PROMPTS, max_new_tokens=14, eos_ids=(2, 7, 11))
    got = engine(llama, GenerateConfig(max_new_tokens=14, eos_ids=(2, 7, 11)), 2).generate(
        PROMPTS, IDS)
    assert tokens(got) == want
    assert len({len(w) for w in want}) > 1


def test_the_tail_moves_rows_to_low_slots_and_steps_fewer_rows(llama):
    # 8 records in 8 slots; the ones in the low slots finish first: the long ones left are
    # moved down, so the tail steps on the small graphs, their tokens unchanged
    config = GenerateConfig(max_new_tokens=24)
    prompts = [[3 + i, 9, 4 + i] for i in range(8)]
    params = [RequestParams(max_new_tokens=n) for n in (3, 3, 3, 3, 3, 3, 20, 24)]
    eng = engine(llama, config, 8)
    got = eng.generate(prompts, list(range(8)), params)
    alone = engine(llama, config, 1).generate(prompts, list(range(8)), params)
    assert tokens(got) == tokens(alone)
    assert eng.stats.moved_rows == 3  # 6, 7 -> 0, 1; then the last alone -> 0
    # about 3 steps of 8 rows, then about 20 of 2 or 3: not 23 steps of 8
    assert eng.stats.decode_row_steps < 8 * 5 + 3 * 20


def test_blocks_are_freed_and_reused_from_a_small_pool(llama):
    # 8 blocks of 4 tokens: one record of 16 + 10 tokens takes 7 at most, so records take turns
    config = GenerateConfig(max_new_tokens=10, eos_ids=(2,))
    prompts = [[9, 8, 7, 6, 5, 4, 3, 1, 30, 31, 32, 33, 34][: 5 + i] for i in range(8)]
    small = engine(llama, config, 4, num_blocks=8)
    got = small.generate(prompts)
    assert tokens(got) == tokens(engine(llama, config, 4).generate(prompts))
    assert small.blocks.free == 7 and small.blocks.used == 0  # all back in the pool
    assert 0 < small.stats.kv_blocks_peak <= 7


def test_a_block_pool_hands_out_the_lowest_blocks_and_never_the_trash_block():
    pool = BlockPool(6)
    first = pool.take(3)
    assert first == [1, 2, 3] and pool.free == 2
    pool.give([2])
    assert pool.take(2) == [2, 4]
    with pytest.raises(RuntimeError):
        pool.take(3)


def test_per_record_parameters_are_honoured(llama):
    config = GenerateConfig(max_new_tokens=12, eos_ids=(2,),
                            sampling=Sampling(method="sample", temperature=1.0, seed=3))
    eng = engine(llama, config, 3, filtered=True)
    greedy = hf_greedy(llama, PROMPTS[:2], max_new_tokens=5, eos_ids=(2,))
    full = hf_greedy(llama, PROMPTS[:1], max_new_tokens=12, eos_ids=(2,))[0]
    params = [RequestParams(temperature=0.0, max_new_tokens=5),  # greedy, 5 tokens
              RequestParams(temperature=0.0, max_new_tokens=5),
              RequestParams(max_new_tokens=3),  # sampled, the spec's seed
              RequestParams(top_k=1),  # top-k 1 is greedy whatever the draw
              RequestParams(temperature=0.0, stop_token_ids=(full[2],))]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[0]]
    got = eng.generate(prompts, ["a", "b", "c", "d", "e"], params)
    assert tokens(got[:2]) == greedy
    assert len(got[2].token_ids) <= 3
    assert got[3].token_ids == full
    assert got[4].token_ids == full[:full.index(full[2]) + 1]  # its own stop id, added
    assert got[4].finish_reason == "eos"
    seeded = engine(llama, config, 2, filtered=True).generate(
        [PROMPTS[2]] * 2, ["c", "c"], [RequestParams(seed=11), RequestParams(seed=12)])
    alone = engine(llama, config, 1, filtered=True).generate(
        [PROMPTS[2]], ["c"], [RequestParams(seed=11)])
    assert seeded[0].token_ids == alone[0].token_ids  # the seed, not the neighbour, decides


def test_parameters_the_engine_cannot_serve_name_the_record(llama):
    eng = engine(llama, GenerateConfig(max_new_tokens=4), 2)
    with pytest.raises(GenerationError, match=r"record 'x'.*temperature"):
        eng.generate([[1, 2]], ["x"], [RequestParams(temperature=0.7)])
    with pytest.raises(GenerationError, match=r"record 'y'.*max_new_tokens 9"):
        eng.generate([[1, 2]], ["y"], [RequestParams(max_new_tokens=9)])
    with pytest.raises(GenerationError, match=r"record 3: its prompt has 17 tokens"):
        eng.generate([[1] * 17], [3])


def test_the_graph_table_holds_one_decode_graph_per_row_count(llama):
    eng = engine(llama, GenerateConfig(max_new_tokens=40), 8)
    kinds = sorted((g["kind"], g["shape"][g["axis"]]) for g in eng.graphs())
    assert [k for k in kinds if k[0] == "decode"] == [("decode", n) for n in (1, 2, 4, 8)]
    assert [k for k in kinds if k[0] == "prefill"] == [("prefill", 16)]
    eng.generate([[1, 2, 3]] * 3 + [[4] * 16])
    assert len(eng.graphs()) == 5  # long completions needed no other graph
    assert eng.stats.decode_row_steps >= eng.stats.useful_steps > 0
    assert not eng.state.host["block_table"].any()  # every row gone, its blocks with it


def test_the_default_decode_ladder_has_halfway_sizes_from_sixteen_rows_and_the_slots():
    assert decode_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert decode_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert decode_sizes(6) == [1, 2, 4, 6]
    assert decode_sizes(40, [3, 12, 99]) == [3, 12, 40]


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_captured_steps_equal_eager_steps_on_a_gpu(llama):
    config = GenerateConfig(max_new_tokens=12, eos_ids=(2, 7))
    prompts = [PROMPTS[i % len(PROMPTS)] + [i] for i in range(20)]
    eager = engine(llama, config, 4).generate(prompts)
    graphs = engine(llama, config, 4, device="cuda")
    assert all(g["status"] == "captured" for g in graphs.graphs()), graphs.graphs()
    assert tokens(graphs.generate(prompts)) == tokens(eager)
    assert graphs.blocks.used == 0 and graphs.stats.host_bound_steps is not None


def test_a_record_batchs_own_parameters_reach_their_rows(tmp_path):
    import numpy as np

    import graphrun
    from graphrun.generate.runner import GenerationRunner
    from graphrun.spec.request import REQUEST_FIELD
    from tests.test_generate_job import NEW, write_spec

    runner = GenerationRunner(graphrun.load_spec(write_spec(tmp_path, n=3)))
    try:
        prompts = np.array([[5, 6, 7, 0], [8, 9, 0, 0], [10, 11, 12, 13]])
        own = np.empty(3, dtype=object)
        own[:] = [RequestParams(max_new_tokens=2), None, RequestParams()]
        fields = {"input_ids": prompts, REQUEST_FIELD: own}
        lengths = {"seq": np.array([3, 2, 4])}
        bucket = runner.launcher.stage(fields, 3, lengths, 0, ids=np.array([0, 1, 2]))
        rows, _ = runner.launcher.launch(bucket, 0, 3, lengths).result()
    finally:
        runner.close()
    assert rows["output_tokens"].tolist() == [2, NEW, NEW]
    assert rows["prompt_tokens"].tolist() == [3, 2, 4]


def test_slots_auto_on_the_cpu_are_the_largest_decode_size(llama):
    eng = engine(llama, GenerateConfig(max_new_tokens=4), "auto", rows=[2, 6])
    assert eng.slots == 6 and eng.decode_sizes == [2, 6]
    assert engine(llama, GenerateConfig(max_new_tokens=4), "auto").slots == 16


def pieces(ids):
    """A detokenizer of the tiny vocabulary: id i -> "<letter><digit>", so a string may start
    inside one token and end inside the next."""
    return "".join(chr(ord("a") + i % 26) + str(i % 10) for i in ids)


def cut_at(want: list[int], stop: str) -> tuple[list[int], str, str]:
    """The reference: the greedy tokens up to the one whose text first holds `stop`, the text
    before it, and the finish reason."""
    for k in range(1, len(want) + 1):
        text = pieces(want[:k])
        if stop in text:
            return want[:k], text[:text.index(stop)], "stop"
    return want, pieces(want), "length"


def test_stop_strings_end_the_text_before_the_string_as_transformers_tokens_cut_there(llama):
    want = hf_greedy(llama, PROMPTS, max_new_tokens=12)
    # a string from the middle of each record's own text: it starts inside token 3
    stops = [pieces(w)[7:10] for w in want]
    params = [RequestParams(stop_strings=(s,)) for s in stops]
    for slots in (1, 3):
        eng = engine(llama, GenerateConfig(max_new_tokens=12), slots, detokenize=pieces)
        got = eng.generate(PROMPTS, IDS, params)
        for c, w, s in zip(got, want, stops):
            ids, text, reason = cut_at(w, s)
            assert (c.token_ids, c.text, c.finish_reason) == (ids, text, reason)
            assert reason == "stop" and len(ids) < len(w)
        assert eng.stats.finish_reasons == {"stop": len(PROMPTS)}


def test_spec_stop_strings_apply_to_every_record_and_a_records_own_are_added(llama):
    want = hf_greedy(llama, PROMPTS[:2], max_new_tokens=12)
    spec_stop, own = pieces(want[0])[10:12], pieces(want[1])[4:7]
    config = GenerateConfig(max_new_tokens=12, stop_strings=(spec_stop,))
    got = engine(llama, config, 2, detokenize=pieces).generate(
        PROMPTS[:2], IDS[:2], [None, RequestParams(stop_strings=(own,))])
    assert (got[0].token_ids, got[0].text) == cut_at(want[0], spec_stop)[:2]
    first = min((cut_at(want[1], s) for s in (spec_stop, own)),
                key=lambda r: (len(r[0]), r[2] != "stop"))
    assert (got[1].token_ids, got[1].text, got[1].finish_reason) == first


def test_a_stop_string_never_in_the_text_leaves_the_completion_as_it_was(llama):
    want = hf_greedy(llama, PROMPTS[:2], max_new_tokens=8, eos_ids=(2,))
    got = engine(llama, GenerateConfig(max_new_tokens=8, eos_ids=(2,)), 2,
                 detokenize=pieces).generate(PROMPTS[:2], IDS[:2],
                                             [RequestParams(stop_strings=("#",))] * 2)
    assert tokens(got) == want and all(c.text is None for c in got)


def test_stop_strings_need_a_detokenizer(llama):
    with pytest.raises(GenerationError, match="stop strings need the tokenizer"):
        engine(llama, GenerateConfig(max_new_tokens=4, stop_strings=("x",)), 2)
    with pytest.raises(GenerationError, match=r"record 'z'.*stop strings"):
        engine(llama, GenerateConfig(max_new_tokens=4), 2).generate(
            [[1, 2]], ["z"], [RequestParams(stop_strings=("x",))])


def test_n_samples_each_draw_their_own_stream_and_sample_0_is_the_single_draw(llama):
    prompts = [PROMPTS[0], PROMPTS[2]]
    single = tokens(engine(llama, SAMPLED, 2).generate(prompts, ["a", "b"]))
    runs = []
    for slots in (1, 4, 8):
        got = engine(llama, SAMPLED, slots).generate(prompts, ["a", "b"],
                                                     [RequestParams(n=3), RequestParams(n=3)])
        assert [c.sample for c in got] == [0, 1, 2, 0, 1, 2]
        runs.append(tokens(got))
    assert all(run == runs[0] for run in runs[1:])
    assert [runs[0][0], runs[0][3]] == single  # sample 0 of n is the record's n=1 completion
    for samples in (runs[0][:3], runs[0][3:]):
        assert len({tuple(t) for t in samples}) == 3


def test_the_spec_n_is_every_prompts_samples_unless_a_record_gives_its_own(llama):
    config = GenerateConfig(max_new_tokens=6, n=2, sampling=SAMPLED.sampling)
    got = engine(llama, config, 3).generate(PROMPTS[:2], IDS[:2], [None, RequestParams(n=1)])
    assert [c.sample for c in got] == [0, 1, 0]
    alone = engine(llama, GenerateConfig(max_new_tokens=6, sampling=SAMPLED.sampling), 1)
    assert tokens(got)[2:] == tokens(alone.generate(PROMPTS[1:2], IDS[1:2]))


def test_samples_admitted_together_prefill_their_prompt_once(llama):
    prompts, params = [PROMPTS[0], PROMPTS[3]], [RequestParams(n=3), RequestParams(n=2)]
    together = engine(llama, SAMPLED, 8)
    got = together.generate(prompts, ["a", "b"], params)
    # 4 + 6 tokens in one prefill of 16 (the five rows' 24 would take two)
    assert together.stats.prefills == 1 and together.stats.prefill_tokens == 16
    # the 4-token prompt's one full block is shared; the 6-token one's partial block copied
    assert together.stats.copied_blocks == 1
    assert len({tuple(t) for t in tokens(got)}) == 5
    apart = engine(llama, SAMPLED, 1).generate(prompts, ["a", "b"], params)
    assert tokens(got) == tokens(apart)  # each sample prefilled on its own there


def test_samples_hold_their_prompts_full_blocks_by_reference(llama):
    prompt = [(7 * i) % 90 + 3 for i in range(10)]  # 2 full blocks of 4 and a partial one
    config = GenerateConfig(max_new_tokens=6, sampling=SAMPLED.sampling)
    eng = engine(llama, config, 4)
    got = eng.generate([prompt], ["p"], [RequestParams(n=4)])
    # 4 blocks a row (10 + 6 tokens): sample 0's 4, then 2 of its own for each other sample
    assert eng.stats.kv_blocks_peak == 4 + 3 * 2
    assert eng.stats.copied_blocks == 3  # the partial block, to each other sample
    assert eng.blocks.used == 0 and all(eng.blocks.refs(b) == 0 for b in range(eng.num_blocks))
    for cache in (True, False):  # one sample at a time, each prefilled (or read from the cache)
        alone = engine(llama, config, 1, prefix_cache=cache)
        assert tokens(alone.generate([prompt], ["p"], [RequestParams(n=4)])) == tokens(got)
    assert len({tuple(t) for t in tokens(got)}) == 4


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_stop_strings_and_samples_on_captured_steps_equal_the_eager_ones(llama):
    want = hf_greedy(llama, PROMPTS, max_new_tokens=12)
    params = [RequestParams(stop_strings=(pieces(w)[7:10],), n=2) for w in want]
    eager = engine(llama, SAMPLED, 4, device="cuda", backend="eager",
                   detokenize=pieces).generate(PROMPTS, IDS, params)
    graphs = engine(llama, SAMPLED, 4, device="cuda", detokenize=pieces)
    got = graphs.generate(PROMPTS, IDS, params)
    assert [(c.token_ids, c.text, c.finish_reason) for c in got] == [
        (c.token_ids, c.text, c.finish_reason) for c in eager]
    assert graphs.stats.copied_blocks > 0 and graphs.blocks.used == 0


def test_the_wasted_row_steps_are_split_by_cause_and_add_up(llama):
    from graphrun.job.progress import generation_line
    from graphrun.manifest.sections import generation_summary

    # 24 prompts through 8 slots, ending after 1-12 tokens: slots free up at different steps
    prompts = [[3 + i % 9, 9, 4 + i % 5] for i in range(24)]
    params = [RequestParams(max_new_tokens=1 + (7 * i) % 12) for i in range(24)]
    config = GenerateConfig(max_new_tokens=12)
    wastes = {}
    for admit in (1, 4):
        eng = engine(llama, config, 8, admit_min=admit)
        eng.generate(prompts, list(range(24)), params)
        g = generation_summary(eng.stats, [50], slots=8, kv_block_size=4, kv_blocks=9,
                               kv_cache_bytes=1)
        w = g.waste
        assert w.admission + w.no_prompt + w.stopped == g.decode_row_steps - g.useful_steps
        assert min(w.admission, w.no_prompt, w.stopped) >= 0
        # a finished row is stepped once more at most: the launch before it is read
        assert 0 < w.stopped <= g.records
        assert w.no_prompt > 0  # the tail: no prompt left, rows finishing
        assert "(no prompt waiting " in generation_line(g)
        wastes[admit] = w
    # waiting for 4 free slots leaves slots empty while prompts wait
    assert wastes[4].admission > wastes[1].admission


def test_a_free_slot_waits_a_few_steps_at_most_when_too_few_others_free_up(llama, monkeypatch):
    """Rows that end together (every completion max_new_tokens long) can leave fewer than
    admit_min slots free for many steps: after ADMIT_WAIT decode steps a prefill takes them
    anyway. The completions do not depend on when a prompt was admitted."""
    from graphrun.generate import engine as engine_module

    # 8 slots, a prefill waits for 4: record 0 ends after 2 tokens, the others after 30, so
    # one slot is free from about step 2 while the next free up only at step 30; more
    # prompts than the scheduler looks ahead over (an input that ended is admitted at once)
    n = 48
    prompts = [[3 + i % 9, 4 + i % 5] for i in range(n)]  # 8 of them fill one prefill
    params = [RequestParams(max_new_tokens=2 if i == 0 else 30) for i in range(n)]
    config = GenerateConfig(max_new_tokens=30)
    runs = {}
    for wait in (engine_module.ADMIT_WAIT, 10**9):
        monkeypatch.setattr(engine_module, "ADMIT_WAIT", wait)
        eng = engine(llama, config, 8, admit_min=4)
        runs[wait] = (tokens(eng.generate(prompts, list(range(n)), params)), eng.stats)
    (got, waited), (want, held) = runs[engine_module.ADMIT_WAIT], runs[10**9]
    assert got == want
    # held: slot 0 idle until step 30; waited: record 8 took it after ADMIT_WAIT steps
    assert held.empty_waiting_row_steps >= 25
    assert waited.empty_waiting_row_steps <= engine_module.ADMIT_WAIT + 3
