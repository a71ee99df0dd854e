"""graphrun.LLM, graphrun.generate and graphrun.chat on the CPU with the shipped tiny Llama:
the job's completions for the same spec and prompts, transformers' greedy generate per prompt,
each prompt's own parameters, the caller's order, and bad prompts refused before any work."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import graphrun
from tests.overlap import most_at_once
from tests.test_generate_job import FOLDER, NEW, completions, hf, hf_greedy, write_spec

__all__ = ["hf"]  # the fixture, shared with the job's tests

ROOT = Path(__file__).resolve().parents[1]
CHATS = ROOT / "examples" / "data" / "chats.jsonl"


@pytest.fixture(scope="module")
def llm():
    with graphrun.LLM(str(FOLDER), max_new_tokens=NEW, max_prompt_tokens=512,
                      device="cpu") as engine:
        yield engine


def prompts_of(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "prompts.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("sampling", [{"method": "greedy"},
                                      {"method": "sample", "temperature": 0.9, "seed": 7}])
def test_generate_equals_the_jobs_outputs_for_the_same_spec(tmp_path, sampling):
    spec = graphrun.load_spec(write_spec(tmp_path, n=9, generate={"max_new_tokens": NEW,
                                                                  "sampling": sampling}))
    graphrun.run(spec)
    rows = completions(tmp_path / "out")
    records = [{"id": p["id"], "prompt": p["prompt"]} for p in prompts_of(tmp_path)]
    got = graphrun.generate(spec, records)
    assert [g.id for g in got] == [r["id"] for r in rows]
    for g, row in zip(got, rows):
        assert (g.token_ids, g.text, g.finish_reason, g.prompt_tokens, g.output_tokens) == (
            row["token_ids"], row["text"], row["finish_reason"], row["prompt_tokens"],
            row["output_tokens"]), row["id"]


def test_chat_equals_the_chat_jobs_outputs(tmp_path):
    spec = graphrun.load_spec(ROOT / "pipelines" / "chat.yaml",
                              overrides=[f"output.dir={tmp_path / 'out'}", "device=cpu",
                                         "generate.max_new_tokens=5"])
    graphrun.run(spec)
    rows = completions(tmp_path / "out")
    chats = [json.loads(line) for line in CHATS.read_text().splitlines()]
    with graphrun.LLM(spec) as engine:
        got = engine.chat([{"id": c["id"], "messages": c["messages"]} for c in chats])
        one = engine.chat(chats[1]["messages"])  # a single conversation
    assert [(g.id, g.token_ids, g.text) for g in got] == [
        (r["id"], r["token_ids"], r["text"]) for r in rows]
    assert one[0].token_ids == rows[1]["token_ids"]


def test_greedy_equals_transformers_generate_per_prompt(hf, llm):
    texts = [p["prompt"] for p in prompts_of_examples(5)]
    got = llm.generate(texts)
    tok = hf[0]
    for g, text in zip(got, texts):
        want = hf_greedy(hf, text)
        assert g.token_ids == want
        assert g.text == tok.decode(want, skip_special_tokens=True)
        assert g.prompt_tokens == len(tok(text).input_ids)
    ids = tok(texts[0]).input_ids
    assert llm.generate([ids])[0].token_ids == got[0].token_ids  # token ids in: the same


def prompts_of_examples(n: int) -> list[dict]:
    path = ROOT / "examples" / "data" / "prompts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def test_each_prompts_own_parameters_are_honoured_and_order_kept(llm):
    texts = [p["prompt"] for p in prompts_of_examples(4)]
    greedy = [g.token_ids for g in llm.generate(texts)]
    stop = greedy[2][2]  # the third prompt's third greedy token
    got = llm.generate([
        {"prompt": texts[0], "max_new_tokens": 2, "id": "short"},
        {"prompt": texts[1], "temperature": 1.5, "seed": 3},
        {"prompt": texts[2], "stop_token_ids": [stop]},
        texts[3],
    ])
    assert [g.id for g in got] == ["short", 1, 2, 3]
    assert got[0].token_ids == greedy[0][:2] and got[0].finish_reason == "length"
    first = greedy[2].index(stop)
    assert got[2].token_ids == greedy[2][:first + 1] and got[2].finish_reason == "eos"
    assert got[3].token_ids == greedy[3]
    again = llm.generate([{"prompt": texts[1], "temperature": 1.5, "seed": 3, "id": 1}])[0]
    other = llm.generate([{"prompt": texts[1], "temperature": 1.5, "seed": 4, "id": 1}])[0]
    assert got[1].token_ids == again.token_ids  # the record's seed and id, whatever its slot
    assert other.token_ids != got[1].token_ids and got[1].token_ids != greedy[1]
    # the call's parameters for all, a prompt's own winning
    both = llm.generate([texts[0], {"prompt": texts[0], "max_new_tokens": 3}], max_new_tokens=1)
    assert [b.token_ids for b in both] == [greedy[0][:1], greedy[0][:3]]


def test_a_stop_string_ends_the_text_before_it_as_the_job_writes_it(tmp_path, llm):
    prompt = prompts_of_examples(3)[2]["prompt"]
    full = llm.generate(prompt)[0]
    # a stop string inside the greedy text, past its first character (text is left before it)
    at = next(i for i in range(1, len(full.text) - 2) if "\ufffd" not in full.text[i:i + 3])
    stop = full.text[at:at + 3]
    got = llm.generate(prompt, stop=[stop])[0]
    assert got.finish_reason == "stop"
    assert got.text == full.text[:full.text.index(stop)] != full.text
    assert full.token_ids[:len(got.token_ids)] == got.token_ids
    # the job with the same stop string writes the same record
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"id": "p", "prompt": prompt}) + "\n")
    spec = graphrun.load_spec(write_spec(tmp_path), overrides=[
        f"data.path={data}", f"generate.max_new_tokens={NEW}", "data.group_by_length=null",
        f"generate.stop.strings={json.dumps([stop])}"])
    graphrun.run(spec)
    row = completions(tmp_path / "out")[0]
    assert (row["text"], row["token_ids"], row["finish_reason"]) == (
        got.text, got.token_ids, got.finish_reason)


def test_bad_prompts_are_refused_together_naming_their_places(llm):
    with pytest.raises(graphrun.InputError) as err:
        llm.generate(["fine", {"prompt": "x", "temperature": -1}, {"text": "y"},
                      {"prompt": [9999]}, {"prompt": "z", "logprobs": 2},
                      {"prompt": "w", "max_new_tokens": NEW + 1}])
    message = str(err.value)
    assert "5 of 6 prompts" in message
    for part in ("[1] temperature", "[2] give one of prompt or messages",
                 "[3] token ids outside the model's vocabulary of 512",
                 "[4] logprobs is served by `graphrun run`",
                 f"[5] max_new_tokens {NEW + 1} is more than the job's cap"):
        assert part in message
    with pytest.raises(graphrun.InputError) as err:
        llm.generate([[], [1, None], 3.5])
    for part in ("[0] prompt: an empty list of token ids", "[1] prompt: expected a string or a "
                 "list of token ids, got null at place 1", "[2] prompt: expected a string or a "
                 "list of token ids, got 3.5"):
        assert part in str(err.value)
    with pytest.raises(graphrun.InputError, match=r"\[0\].*600 tokens; give 1 to 512"):
        llm.generate([[1] * 600])
    with pytest.raises(graphrun.InputError, match="unknown parameter 'temprature'"):
        llm.generate(["x"], temprature=0.5)
    # a call's keyword is named as the keyword, not as a spec key it never wrote
    with pytest.raises(graphrun.InputError, match=r"^generate: max_new_tokens: 0 is not a "
                       r"whole number >= 1$"):
        llm.generate(["x"], max_new_tokens=0)
    assert "per_record" not in message
    # n > 1 is the job's (an OpenAI Batch line's choices): said so, not the job's advice
    with pytest.raises(graphrun.InputError, match=r"\[0\] n > 1 \(several samples\) is served "
                       r"by `graphrun run`") as err:
        llm.generate([{"prompt": "x", "n": 2}])
    assert "output.format" not in str(err.value)


def test_chat_refuses_a_plain_prompt_and_names_generate(llm):
    """A dict with `prompt` given to chat() was served as a plain prompt, no template rendered."""
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(graphrun.InputError) as err:
        llm.chat([hi, {"id": "p", "prompt": "An old fisherman"},
                  {"prompt": "x", "messages": hi}, {"id": "q"}], max_new_tokens=2)
    message = str(err.value)
    assert "3 of 4 prompts" in message and "[0]" not in message
    for i in (1, 2):
        assert (f"[{i}] 'prompt' is a plain prompt, which chat() does not take: give a "
                "conversation as messages, or the prompt to generate()") in message
    assert "[3] give messages" in message
    # the same dict is generate()'s, and a dict with messages is chat()'s
    assert llm.generate({"prompt": "An old fisherman"}, max_new_tokens=2)[0].output_tokens == 2
    assert llm.chat({"id": "c", "messages": hi}, max_new_tokens=2)[0].id == "c"


def test_a_list_of_token_ids_is_one_prompt(llm):
    """An int is no prompt of its own: [5, 6, 7] is one prompt, as [[5, 6, 7]] is."""
    one = llm.generate([5, 6, 7], max_new_tokens=2)
    assert len(one) == 1 and one[0].token_ids == llm.generate([[5, 6, 7]],
                                                              max_new_tokens=2)[0].token_ids


def test_numpy_token_ids_are_token_ids(llm):
    """A list of numpy ints, or a 1-d numpy array (a tokenizer's output), was refused as
    "expected a string or a list of token ids"."""
    want = llm.generate([[5, 6, 7]], max_new_tokens=2)[0].token_ids
    for prompt in (np.array([5, 6, 7]), [np.int64(5), np.int32(6), np.int64(7)]):
        assert llm.generate([prompt], max_new_tokens=2)[0].token_ids == want
    assert llm.generate(np.array([5, 6, 7]), max_new_tokens=2)[0].token_ids == want
    with pytest.raises(graphrun.InputError, match="outside the model's vocabulary"):
        llm.generate([np.array([5, -1])])


def test_calls_from_two_threads_run_one_after_another_with_their_own_outputs(llm):
    """The engine's slots and KV cache serve one call at a time: a second thread's call waits
    for the first instead of stepping the same rows (which cut and mixed both calls' tokens)."""
    prompts = {1: ["An old fisherman", "The storm"], 2: ["x", "The harbour at dawn", "y"]}
    alone = {k: [o.token_ids for o in llm.generate(p)] for k, p in prompts.items()}
    got = {}

    def call(k):
        got[k] = [o.token_ids for o in llm.generate(prompts[k])]

    assert most_at_once(llm.engine, "generate", [lambda k=k: call(k) for k in prompts]) == 1
    assert got == alone


def test_a_closed_llm_says_so():
    engine = graphrun.LLM(str(FOLDER), max_new_tokens=2, max_prompt_tokens=64, device="cpu")
    engine.close()
    engine.close()  # a second close does nothing
    with pytest.raises(graphrun.GraphrunError, match="this graphrun.LLM is closed"):
        engine.generate("x")
    with pytest.raises(graphrun.GraphrunError, match="build a new LLM"):
        engine.chat([{"role": "user", "content": "hi"}])


def test_runner_on_a_generation_spec_names_the_in_process_entry(tmp_path):
    spec = graphrun.load_spec(write_spec(tmp_path, n=2))
    with pytest.raises(graphrun.SpecError, match=r"graphrun.LLM\(spec\).generate"):
        graphrun.Runner(spec)


def test_a_spec_without_generate_or_a_missing_folder_is_refused(tmp_path):
    spec = graphrun.load_spec(ROOT / "pipelines" / "decoder-step.yaml")
    with pytest.raises(graphrun.SpecError, match="no generate: section"):
        graphrun.LLM(spec)
    with pytest.raises(graphrun.SpecError, match="neither a spec"):
        graphrun.generate(str(tmp_path / "nowhere"), ["x"])


@pytest.mark.parametrize("sized", [{"max_new_tokens": 0}, {"max_prompt_tokens": 0},
                                   {"max_prompt_tokens": -4}, {"max_new_tokens": 2.5}])
def test_a_folders_sizes_out_of_range_are_refused_not_replaced_by_the_default(sized):
    """max_new_tokens=0 built an engine of the default 256 new tokens; max_prompt_tokens=-4
    was refused as a max_new_tokens problem."""
    name = next(iter(sized))
    with pytest.raises(graphrun.SpecError, match=f"{name}: .* is not a whole number >= 1"):
        graphrun.LLM(str(FOLDER), device="cpu", **sized)


def test_a_prompt_past_a_folders_longest_names_the_llms_argument_not_spec_keys(tmp_path):
    long = " ".join(["word"] * 40)
    with graphrun.LLM(str(FOLDER), max_new_tokens=2, max_prompt_tokens=8, device="cpu") as eng:
        for call, item in ((eng.generate, long), (eng.chat, [{"role": "user", "content": long}])):
            with pytest.raises(graphrun.InputError) as got:
                call([item])
            said = str(got.value)
            assert "more than 8" in said and "max_prompt_tokens=N" in said, said
            assert "data.text" not in said, said
    # an LLM of a spec names the spec's keys, which are what that user edits
    spec = graphrun.load_spec(write_spec(tmp_path, n=2,
                                         data__text={"field": "prompt", "truncate": False}))
    with graphrun.LLM(spec) as eng, pytest.raises(graphrun.InputError,
                                                 match="data.text.truncate: true"):
        eng.generate([" ".join(["word"] * 2000)])


def test_a_prompt_too_long_says_what_can_still_be_changed():
    """Below the model's positions the advice is max_prompt_tokens up to them; at them
    (the default), raising it cannot help, so the advice is a smaller max_new_tokens."""
    long = "word " * 3000
    with graphrun.LLM(str(FOLDER), max_new_tokens=8, max_prompt_tokens=64, device="cpu") as llm:
        with pytest.raises(graphrun.InputError, match=r"max_prompt_tokens=N\), N up to 1016"):
            llm.generate(long)
    with graphrun.LLM(str(FOLDER), max_new_tokens=8, device="cpu") as llm:
        with pytest.raises(graphrun.InputError) as e:
            llm.generate(long)
    said = str(e.value)
    assert "more than 1016" in said and "smaller max_new_tokens" in said
    assert "the model's 1024 positions less max_new_tokens 8)" in said
    assert "max_prompt_tokens=N" not in said


def test_the_one_call_functions_take_the_llms_own_keywords():
    """graphrun.generate(spec, ..., overrides=[...]) as LLM(spec, overrides=...) does; a
    folder's engine sized for the call's max_new_tokens."""
    spec = ROOT / "pipelines" / "generate.yaml"
    out = graphrun.generate(str(spec), "An old fisherman",
                            overrides=["generate.max_new_tokens=3"])
    assert len(out[0].token_ids) == 3
    out = graphrun.generate(str(FOLDER), ["hi"], max_new_tokens=300, max_prompt_tokens=16,
                            device="cpu")
    assert 1 <= len(out[0].token_ids) <= 300


def test_overrides_that_cannot_apply_are_refused_not_dropped(tmp_path):
    """A folder's or a PipelineSpec's overrides were dropped unsaid (the engine ran 256 new
    tokens for generate.max_new_tokens=3); one string was a --set per character."""
    with pytest.raises(graphrun.SpecError, match="overrides apply to a spec file, as --set; "
                                                 "a model folder's engine takes max_new_tokens"):
        graphrun.LLM(str(FOLDER), overrides=["generate.max_new_tokens=3"], device="cpu")
    spec = graphrun.load_spec(write_spec(tmp_path, n=2))
    with pytest.raises(graphrun.SpecError, match="pass the file's path, or change the "
                                                 "PipelineSpec's fields"):
        graphrun.LLM(spec, overrides=["generate.max_new_tokens=3"])
    with pytest.raises(graphrun.SpecError) as got:
        graphrun.LLM(str(ROOT / "pipelines" / "generate.yaml"),
                     overrides="generate.max_new_tokens=3")
    assert [p.message for p in got.value.problems] == [
        "expected a list of 'key.path=value' strings, got one string: pass "
        "overrides=['generate.max_new_tokens=3']"]


def test_a_calls_parameter_given_to_the_constructor_says_where_it_goes():
    """LLM(folder, temperature=0.5), as vLLM's users write it, was Python's TypeError."""
    with pytest.raises(graphrun.SpecError, match=r"temperature is a parameter of each call: "
                                                 r"llm\.generate\(prompts, temperature=\.\.\.\)"):
        graphrun.LLM(str(FOLDER), temperature=0.5)
    with pytest.raises(graphrun.SpecError, match=r"unknown keyword 'foo': LLM\(\) takes overrides"):
        graphrun.LLM(str(FOLDER), foo=1)
