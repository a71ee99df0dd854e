"""Log-probabilities and penalties in the engine's steps (CPU, fp32, tiny seeded models): the
picked tokens' logprobs equal transformers' compute_transition_scores, the top alternatives come
best first, a record asks its own number of them, vLLM's penalties steer greedy completions as a
plain reference loop does, and a job that asks for none of it computes none of it."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from graphrun.generate.config import GenerateConfig, Sampling  # noqa: E402
from graphrun.generate.engine import build_engine  # noqa: E402
from graphrun.generate.token_bytes import text_bytes  # noqa: E402
from graphrun.spec.request import RequestParams  # noqa: E402
from tests.generate_models import IDS, PROMPTS, tiny_llama  # noqa: E402

NEW = 8


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def engine(model, config, slots=2, **kwargs):
    return build_engine(copy.deepcopy(model), config, slots=slots, max_prompt=16, block_size=4,
                        **kwargs)


def hf_scores(model, prompt, new):
    """transformers' greedy completion of one prompt and its tokens' normalised transition
    scores (the logprob of each picked token)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             eos_token_id=None, pad_token_id=0)
    scores = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    return out.sequences[0, len(prompt):].tolist(), scores[0].tolist(), out.scores


def test_logprobs_equal_transformers_transition_scores(llama):
    got = engine(llama, GenerateConfig(max_new_tokens=NEW, logprobs=4)).generate(PROMPTS, IDS)
    for prompt, c in zip(PROMPTS, got):
        tokens, scores, raw = hf_scores(llama, prompt, NEW)
        assert c.token_ids == tokens
        assert c.logprobs == pytest.approx(scores, abs=1e-4)
        for j, step in enumerate(raw):  # the top 4 of each step's log_softmax, best first
            want = step[0].float().log_softmax(-1).topk(4)
            assert c.top_ids[j] == want.indices.tolist()
            assert c.top_logprobs[j] == pytest.approx(want.values.tolist(), abs=1e-4)
            assert c.top_logprobs[j] == sorted(c.top_logprobs[j], reverse=True)


def test_a_record_asks_its_own_number_of_alternatives_and_greedy_tokens_stay(llama):
    plain = engine(llama, GenerateConfig(max_new_tokens=NEW)).generate(PROMPTS, IDS)
    asked = [RequestParams(logprobs=2), None, RequestParams(logprobs=0), None, None]
    got = engine(llama, GenerateConfig(max_new_tokens=NEW), logprobs=5).generate(
        PROMPTS, IDS, asked)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    assert [len(t) for t in got[0].top_ids] == [2] * NEW
    assert got[2].top_ids == [[]] * NEW and len(got[2].logprobs) == NEW
    assert got[1].logprobs is None and got[1].top_ids is None


def test_prompt_logprobs_equal_a_forward_pass_log_softmax(llama):
    got = engine(llama, GenerateConfig(max_new_tokens=2, prompt_logprobs=True),
                 slots=3).generate(PROMPTS, IDS)
    plain = engine(llama, GenerateConfig(max_new_tokens=2)).generate(PROMPTS, IDS)
    for prompt, c, p in zip(PROMPTS, got, plain):
        with torch.no_grad():
            lp = llama(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        assert c.prompt_logprobs == pytest.approx(
            [float(lp[t, prompt[t + 1]]) for t in range(len(prompt) - 1)], abs=1e-4)
        assert c.token_ids == p.token_ids and p.prompt_logprobs is None


def test_a_job_asking_nothing_computes_nothing(llama):
    eng = engine(llama, GenerateConfig(max_new_tokens=NEW))
    assert eng.state.counts.shape[1] == 0 and eng.state.top_ids.shape[1] == 0
    assert not (eng.variant.penalized or eng.variant.filtered or eng.variant.sample)
    assert eng.variant.logprobs is None and eng.state.p_logprobs.numel() == 0
    assert all(c.logprobs is None for c in eng.generate(PROMPTS, IDS))


def vllm_penalized(logits, prompt, output, repetition, presence, frequency):
    """vLLM's apply_penalties on one row, as its code writes it (in-place masked ops)."""
    logits = logits.clone()
    vocab = logits.shape[-1]
    prompt_mask = torch.zeros(vocab, dtype=torch.bool)
    prompt_mask[prompt] = True
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)
    output_mask = counts > 0
    rep = torch.where(prompt_mask | output_mask, repetition, 1.0)
    logits[logits > 0] /= rep[logits > 0]
    logits[logits <= 0] *= rep[logits <= 0]
    logits -= frequency * counts
    logits -= presence * output_mask
    return logits


def reference_greedy(model, prompt, new, **penalties):
    """Greedy decoding by full forward passes, vLLM's penalties applied before each argmax."""
    out = []
    with torch.no_grad():
        for _ in range(new):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            out.append(int(vllm_penalized(logits, prompt, out, **penalties).argmax()))
    return out


PENALTIES = dict(repetition=1.8, presence=0.7, frequency=0.4)


def test_penalties_steer_greedy_as_vllms_formulas_do(llama):
    config = GenerateConfig(max_new_tokens=NEW, sampling=Sampling(
        repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.4))
    got = engine(llama, config, slots=3).generate(PROMPTS, IDS)
    want = [reference_greedy(llama, p, NEW, **PENALTIES) for p in PROMPTS]
    assert [c.token_ids for c in got] == want
    plain = [c.token_ids for c in engine(llama, GenerateConfig(max_new_tokens=NEW)).generate(
        PROMPTS, IDS)]
    assert plain != want  # the penalties changed something: the test can tell


def test_a_records_own_penalties_are_served_on_its_row_and_reset_for_the_next(llama):
    own = RequestParams(repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.4)
    # one slot: each record takes the slot after a penalized one, its counts reset
    params = [own if i % 2 == 0 else None for i in range(len(PROMPTS))]
    got = engine(llama, GenerateConfig(max_new_tokens=NEW), slots=1, penalized=True).generate(
        PROMPTS, IDS, params)
    for prompt, p, c in zip(PROMPTS, params, got):
        want = reference_greedy(llama, prompt, NEW, **(PENALTIES if p else dict(
            repetition=1.0, presence=0.0, frequency=0.0)))
        assert c.token_ids == want


def test_an_engine_without_penalties_or_logprobs_refuses_a_record_asking_them(llama):
    from graphrun.generate.config import GenerationError

    eng = engine(llama, GenerateConfig(max_new_tokens=NEW))
    with pytest.raises(GenerationError, match="without penalties"):
        eng.generate([[3, 4]], params=[RequestParams(presence_penalty=0.5)])
    with pytest.raises(GenerationError, match="no log-probabilities"):
        eng.generate([[3, 4]], params=[RequestParams(logprobs=1)])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_steps_with_logprobs_and_penalties_equal_eager_steps(llama):
    config = GenerateConfig(max_new_tokens=12, eos_ids=(2, 7), logprobs=5, prompt_logprobs=True,
                            sampling=Sampling(repetition_penalty=1.3, presence_penalty=0.2,
                                              frequency_penalty=0.1))
    prompts = [PROMPTS[i % len(PROMPTS)] + [i] for i in range(20)]
    eager = engine(llama, config, 4).generate(prompts)
    graphs = engine(llama, config, 4, device="cuda")
    assert all(g["status"] == "captured" for g in graphs.graphs()), graphs.graphs()
    got = graphs.generate(prompts)
    assert [c.token_ids for c in got] == [c.token_ids for c in eager]
    for g, e in zip(got, eager):
        assert g.logprobs == pytest.approx(e.logprobs, abs=1e-4)
        assert g.top_ids == e.top_ids
        assert g.prompt_logprobs == pytest.approx(e.prompt_logprobs, abs=1e-4)
        assert [x for row in g.top_logprobs for x in row] == pytest.approx(
            [x for row in e.top_logprobs for x in row], abs=1e-4)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_job_writes_each_tokens_logprob_and_its_alternatives(tmp_path, fmt):
    import json

    import pyarrow.parquet as pq
    import transformers

    import graphrun
    from tests.test_generate_job import FOLDER, write_spec

    spec = write_spec(tmp_path, n=3, generate={
        "max_new_tokens": 4, "logprobs": 3, "prompt_logprobs": True,
        "sampling": {"repetition_penalty": 1.5},
        "per_record": {"logprobs": "lp", "presence_penalty": "pp"}},
        output={"dir": str(tmp_path / "out"), "format": fmt})
    data = tmp_path / "prompts.jsonl"
    records = [json.loads(x) for x in data.read_text().splitlines()]
    records[1].update(lp=1, pp=0.5)  # the second asks 1 alternative, and its own penalty
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    graphrun.run(graphrun.load_spec(spec))
    if fmt == "jsonl":
        rows = [json.loads(x) for x in (tmp_path / "out" / "part-00000.jsonl").read_text()
                .splitlines()]
    else:
        rows = pq.read_table(tmp_path / "out" / "part-00000.parquet").to_pylist()
    tok = transformers.AutoTokenizer.from_pretrained(FOLDER)
    model = transformers.AutoModelForCausalLM.from_pretrained(FOLDER).eval()
    for record, row in zip(records, rows):
        k = record.get("lp", 3)
        ids = tok(record["prompt"]).input_ids
        with torch.no_grad():  # the model's own log_softmax: before the penalties
            logits = model(torch.tensor([ids + row["token_ids"]])).logits[0, len(ids) - 1:-1]
        lp = logits.float().log_softmax(-1)
        assert row["logprobs"] == pytest.approx(
            [float(lp[j, t]) for j, t in enumerate(row["token_ids"])], abs=1e-4)
        # each token's own bytes: joined, the completion's text; alone, its decoded text
        # where that is whole characters
        joined = b"".join(bytes(text_bytes(t)) for t in row["tokens"])
        assert joined.decode("utf-8", errors="replace") == tok.decode(row["token_ids"])
        for t, text in zip(row["token_ids"], row["tokens"]):
            alone = tok.decode([t])
            assert text == alone if "\ufffd" not in alone else text.startswith("bytes:\\x")
        assert [len(x) for x in row["top_token_ids"]] == [k] * len(row["token_ids"])
        assert row["top_token_ids"] == lp.topk(k).indices.tolist()
        for ids_at, texts_at in zip(row["top_token_ids"], row["top_tokens"]):
            for t, text in zip(ids_at, texts_at):
                alone = tok.decode([t])
                assert text == alone if "\ufffd" not in alone else text.startswith("bytes:")
        with torch.no_grad():
            lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        assert row["prompt_logprobs"] == pytest.approx(
            [float(lp[t, ids[t + 1]]) for t in range(len(ids) - 1)], abs=1e-4)
