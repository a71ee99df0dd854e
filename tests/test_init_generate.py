"""`graphrun init --hf DIR --task generate`: a generation spec for a causal LM over a prompts
file; it validates, its batch and seq buckets are planned for the grouped batches within a
bounded count of prefill and decode graphs, its seq buckets fit prompt and new tokens into the
model's positions, the written spec runs and pads as init said, `graphrun plan` plans a
generation spec the same way, and a model that is no causal LM is one clear message."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or
    importlib.util.find_spec("tokenizers") is None,
    reason="needs transformers and tokenizers (the hf extra)")

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "models" / "tiny-llama"  # 1024 positions, EOS 1


def cli(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def write_prompts(path: Path, n: int = 30, extra: dict | None = None) -> None:
    words = "the river city train report night garden letter music storm".split()
    rows = [{"id": f"q{i}", "prompt": " ".join(words[: 1 + i % 10]) * (1 + i % 4),
             **(extra or {})} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def init(tmp_path, folder, *extra, data=None):
    if data is None:
        data = tmp_path / "prompts.jsonl"
        write_prompts(data)
    spec_path = tmp_path / "specs" / "gen.yaml"
    result = cli("init", "--hf", folder, "--data", data, "-o", spec_path, "--task", "generate",
                 "--batch-size", 8, *extra)
    return result, spec_path


def test_the_written_spec_is_a_generation_job_that_validates(tmp_path):
    result, spec_path = init(tmp_path, TINY)
    assert result.exit_code == 0, result.output
    assert cli("validate", spec_path).exit_code == 0
    spec = graphrun.load_spec(spec_path)
    assert (spec.model.hf.class_, spec.model.dtype) == ("AutoModelForCausalLM", "float32")
    assert spec.inputs == {} and spec.outputs == {}
    assert spec.data.text.field == "prompt" and spec.data.id_field == "id"
    assert spec.data.group_by_length == 30 and spec.data.batch_size == 8  # the whole file
    g = spec.generate
    assert (g.max_new_tokens, g.sampling.method, g.stop.eos) == (128, "greedy", "auto")
    assert g.slots == "auto"  # a GPU's memory decides; the CPU's, the largest batch
    # 3 batches of 8 and one of 6: no batch bucket between them is ever selected
    assert set(spec.buckets["batch"]) <= {6, 8} and 8 in spec.buckets["batch"]
    seq = spec.buckets["seq"]
    assert all(v % 8 == 0 for v in seq) and seq[-1] + 128 <= 1024
    assert spec.output.format == "jsonl"
    text = spec_path.read_text()
    assert "inputs:" not in text and "outputs:" not in text
    assert "stopping at the model's EOS [1]" in result.output
    assert "generate: 128 new tokens at most, greedy" in result.output
    assert "call (" not in result.output


@pytest.mark.parametrize("newline", [b"\r\n", b"\r"])
def test_a_bom_and_cr_line_ends_are_read_as_run_reads_them(tmp_path, newline):
    """A file with a UTF-8 BOM and CRLF or CR-only line ends: `run` reads every record of it,
    so init samples every one, none left out as bad JSON."""
    data = tmp_path / "prompts.jsonl"
    write_prompts(data, n=12)
    data.write_bytes(b"\xef\xbb\xbf" + data.read_bytes().replace(b"\n", newline))
    result, spec_path = init(tmp_path, TINY, data=data)
    assert result.exit_code == 0, result.output
    assert "read 12 records of prompts.jsonl (of 12)" in result.output
    assert "could not be used" not in result.output
    assert graphrun.load_spec(spec_path).data.group_by_length == 12


def test_seq_buckets_end_where_prompt_and_new_tokens_fill_the_positions(tmp_path):
    """A sample of the file: the last bucket is the positions less max_new_tokens."""
    folder = tmp_path / "short"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 200}))
    result, spec_path = init(tmp_path, folder, "--sample", 10)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(spec_path)
    assert spec.buckets["seq"][-1] == 72  # (200 - 128) rounded down to a multiple of 8
    assert spec.data.text.truncate is False  # a longer prompt is rejected, as the schema says


def test_too_few_positions_for_the_new_tokens_is_one_message(tmp_path):
    folder = tmp_path / "tiny"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 130}))
    result, _ = init(tmp_path, folder)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "the model holds 130 positions, too few for a prompt and 128 new tokens" in \
        result.output


ALPACA = [{"instruction": f"Name a colour, take {i}", "input": "" if i % 3 else f"context {i}",
           "output": "red"} for i in range(30)]
MOSTLY_BLANK = [{"prompt": "" if i % 4 else "hi", "question": f"why {i}?"} for i in range(20)]


@pytest.mark.parametrize("records, field, unused", [
    (None, "prompt", "text"),  # the prompt field is preferred to other text
    (ALPACA, "instruction", "input, output"),  # not Alpaca's often blank, optional input
    (MOSTLY_BLANK, "question", None),  # a named field blank in most records gives way
], ids=["prompt beside text", "alpaca", "mostly blank prompt"])
def test_the_prompt_field_is_the_named_one_that_holds_text(tmp_path, records, field, unused):
    data = tmp_path / "prompts.jsonl"
    if records is None:
        write_prompts(data, extra={"text": "a reference answer"})
    else:
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
    result, spec_path = init(tmp_path, TINY, data=data)
    assert result.exit_code == 0, result.output
    assert graphrun.load_spec(spec_path).data.text.field == field
    if unused:
        assert f"string fields not used: {unused}" in result.output


def test_a_longer_file_is_grouped_in_windows_of_at_most_1024_prompts(tmp_path):
    """A window's completions wait, unwritten, for its first ones (outputs in input order), so
    an interrupt loses up to a window's work: init's generation windows stay small."""
    data = tmp_path / "many.jsonl"
    write_prompts(data, n=2500)
    result, spec_path = init(tmp_path, TINY, data=data)
    assert result.exit_code == 0, result.output
    assert graphrun.load_spec(spec_path).data.group_by_length == 1024  # 128 batches of 8


def test_a_model_that_is_no_causal_lm_is_refused(tmp_path):
    from tests.test_init_hf import save_model

    encoder = save_model(tmp_path / "bert", "embed")
    result, spec_path = init(tmp_path, encoder)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert ("--task generate: config.json names BertModel, which is no causal language model "
            "(a class ending in ForCausalLM or LMHeadModel)") in result.output
    assert not spec_path.exists()


def test_task_generate_needs_hf(tmp_path):
    write_prompts(tmp_path / "p.jsonl")
    result = cli("init", "--builtin", "mlp", "--data", tmp_path / "p.jsonl", "--task",
                 "generate", "-o", tmp_path / "x.yaml")
    assert result.exit_code != 0
    assert "--task generate needs --hf DIR" in result.output


def test_a_causal_lm_over_text_without_task_asks_which(tmp_path):
    """Without --task, a causal LM over text asks: completions (generate) or the next token's
    top k (next-token), never picking one silently."""
    write_prompts(tmp_path / "p.jsonl")
    spec_path = tmp_path / "next.yaml"
    result = cli("init", "--hf", TINY, "--data", tmp_path / "p.jsonl", "-o", spec_path)
    assert result.exit_code != 0 and "Traceback" not in result.output
    said = " ".join(result.output.split())
    assert "is a causal language model: say what to run with --task generate" in said
    assert "--task next-token" in said and not spec_path.exists()
    result = cli("init", "--hf", TINY, "--data", tmp_path / "p.jsonl", "-o", spec_path,
                 "--task", "next-token")
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(spec_path)
    assert spec.generate is None and list(spec.outputs) == ["next_ids", "next_probs"]


def test_generation_options_are_written_and_imply_generate(tmp_path):
    write_prompts(tmp_path / "p.jsonl")
    spec_path = tmp_path / "gen.yaml"
    result = cli("init", "--hf", TINY, "--data", tmp_path / "p.jsonl", "-o", spec_path,
                 "--max-new-tokens", 12, "--temperature", 0.7, "--top-p", 0.9, "--seed", 3)
    assert result.exit_code == 0, result.output
    g = graphrun.load_spec(spec_path).generate
    assert g.max_new_tokens == 12
    assert (g.sampling.method, g.sampling.temperature, g.sampling.top_p, g.sampling.seed) == (
        "sample", 0.7, 0.9, 3)
    check = result.output[result.output.index("check:"):]
    assert "generate: sampled at temperature 0.7, up to 12 new tokens" in check
    assert "greedy" not in check
    result = cli("init", "--hf", TINY, "--data", tmp_path / "p.jsonl", "-o", spec_path,
                 "--force", "--top-p", 0.9)
    assert result.exit_code != 0 and "give --temperature above 0 too" in result.output


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chat_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny-chat"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config,
                                                              "chat_template": CHAT_TEMPLATE}))
    return folder


def test_a_chat_file_is_recognised_and_written_as_data_chat(tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "tell me about the river " * (1 + i % 5)}]}) + "\n"
        for i in range(20)))
    spec_path = tmp_path / "chat.yaml"
    result = cli("init", "--hf", chat_folder(tmp_path), "--data", data, "-o", spec_path,
                 "--max-new-tokens", 4)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(spec_path)
    assert spec.data.chat.field == "messages" and spec.generate.max_new_tokens == 4
    assert spec.data.text.add_special_tokens is False and spec.data.text.truncate is False
    assert "rendered by the model's chat template" in result.output
    assert graphrun.run(spec).totals.records_out == 20


def test_a_chat_file_with_a_few_bad_records_is_still_a_chat_file_and_names_them(tmp_path):
    """A chat file where a few records hold a string, an empty list or a bad message: still
    data.chat (not a text field whose every chat is rejected), and init names each bad one
    with the reason the run gives it."""
    data = tmp_path / "chats.jsonl"
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": "the river " * (1 + i)}]}
            for i in range(12)]
    rows[2]["messages"] = "tell me about the river"
    rows[5]["messages"] = []
    rows[7]["messages"] = [{"role": "wizard", "content": "x"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec_path = tmp_path / "chat.yaml"
    result = cli("init", "--hf", chat_folder(tmp_path), "--data", data, "-o", spec_path)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(spec_path, ["data.on_bad_record=skip", "generate.max_new_tokens=2"])
    assert spec.data.chat.field == "messages"
    said = " ".join(result.output.split())
    m = graphrun.run(spec)
    assert (m.totals.records_out, m.totals.records_rejected) == (9, 3)
    rejects = [json.loads(x) for x in (spec.output.dir / "rejects.jsonl").read_text().splitlines()]
    assert [r["where"] for r in rejects] == ["chats.jsonl:3", "chats.jsonl:6", "chats.jsonl:8"]
    for r in rejects:  # init named each, as the run did
        assert f"{r['where']}: {r['reason']}" in said


def test_an_openai_batch_file_is_recognised_and_written_as_such(tmp_path):
    data = tmp_path / "batch.jsonl"
    data.write_text("".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi " * (i + 1)}]}})
        + "\n" for i in range(10)))
    spec_path = tmp_path / "batch.yaml"
    result = cli("init", "--hf", chat_folder(tmp_path), "--data", data, "-o", spec_path)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(spec_path)
    assert spec.data.format == "openai_batch" and spec.output.format == "openai_batch"
    assert spec.data.id_field == "custom_id" and "string fields not used" not in result.output
    # a request that cannot be served gets its error line in its place, as the Batch API's
    # own do, and the others their responses: the run goes on past it
    assert spec.data.on_bad_record == "skip"
    lines = data.read_text().splitlines()
    lines[3] = lines[3].replace('"messages"', '"temperature": -1, "messages"')
    data.write_text("\n".join(lines) + "\n")
    m = graphrun.run(graphrun.load_spec(spec_path, ["generate.max_new_tokens=2"]))
    assert (m.status, m.totals.records_out, m.totals.records_rejected) == ("completed", 9, 1)
    out = [json.loads(x) for x in (spec.output.dir / "part-00000.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in out] == [f"r{i}" for i in range(10)]
    assert "temperature" in out[3]["error"]["message"] and out[4]["error"] is None


def test_a_batch_file_with_a_body_that_is_no_object_is_still_a_batch_file(tmp_path):
    """One request line whose body is a string: init still writes the Batch job (it was a
    question which task to run), and the run answers that line with an error line."""
    data = tmp_path / "batch.jsonl"
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi " * (i + 1)}]}}
            for i in range(10)]
    rows[4]["body"] = "hi there"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec_path = tmp_path / "batch.yaml"
    result = cli("init", "--hf", chat_folder(tmp_path), "--data", data, "-o", spec_path)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(spec_path, ["generate.max_new_tokens=2"])
    assert spec.data.format == "openai_batch"
    m = graphrun.run(spec)
    assert (m.totals.records_out, m.totals.records_rejected) == (9, 1)
    out = [json.loads(x) for x in (spec.output.dir / "part-00000.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in out] == [f"r{i}" for i in range(10)]
    assert out[4]["error"] is not None and out[3]["error"] is None


def test_a_completions_batch_file_is_planned_from_its_prompts_token_ids_too(tmp_path):
    """A completions file's prompts of token ids (a list of one too) are planned from their
    lengths; a chat body sent to /v1/completions is the run's error line, not the plan."""
    def line(i, body):
        return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                           "body": body}) + "\n"
    prompts = [list(range(5, 5 + 10 * (i + 1))) for i in range(8)]  # 10 to 80 ids
    rows = [line(i, {"prompt": p if i % 2 else [p], "max_tokens": 4})
            for i, p in enumerate(prompts)]
    rows.append(line(8, {"messages": [{"role": "user", "content": "hi"}]}))
    data = tmp_path / "batch.jsonl"
    data.write_text("".join(rows))
    spec_path = tmp_path / "batch.yaml"
    result = cli("init", "--hf", TINY, "--data", data, "-o", spec_path)
    assert result.exit_code == 0, result.output
    assert "token lengths 10-80 in the 9 records sampled" in result.output
    assert "batch.jsonl:9: body has no 'prompt'" in result.output
    spec = graphrun.load_spec(spec_path)
    assert spec.data.format == "openai_batch" and max(spec.buckets["seq"]) >= 80
    m = graphrun.run(graphrun.load_spec(spec_path, ["generate.max_new_tokens=4"]))
    assert (m.totals.records_out, m.totals.records_rejected) == (8, 1)


@pytest.mark.parametrize("batch", [False, True], ids=["chat", "batch"])
def test_a_conversation_far_longer_than_the_rest_is_named_with_its_line(tmp_path, batch):
    """The outlier of a chat or Batch file is named where its conversation is (it was a
    KeyError: the messages are no text field to find the lines of)."""
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": "the river " * (1 + i % 3)}]}
            for i in range(30)]
    rows[7]["messages"][0]["content"] = "word " * 600
    if batch:
        rows = [{"custom_id": r["id"], "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": r["messages"]}} for r in rows]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result, spec_path = init(tmp_path, TINY, data=data)
    assert result.exit_code == 0, result.output
    assert "1 text far longer than the rest, chats.jsonl:8 (" in result.output
    assert cli("validate", spec_path).exit_code == 0


def test_sharegpt_conversations_are_named_with_how_to_make_them_messages(tmp_path):
    data = tmp_path / "sharegpt.jsonl"
    data.write_text("".join(json.dumps({"id": f"s{i}", "conversations": [
        {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}) + "\n"
        for i in range(3)))
    result, _ = init(tmp_path, TINY, data=data)
    assert result.exit_code == 2, result.output
    assert "field 'conversations' holds lists of objects with keys from, value" in result.output
    assert "role: user/assistant and content" in result.output


def test_a_chat_file_for_a_model_without_a_template_is_one_message(tmp_path):
    from tests.test_chat import chat_model

    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"id": 0, "messages": [{"role": "user", "content": "x"}]}) + "\n")
    bare = chat_model(tmp_path / "bare", template=None)
    result = cli("init", "--hf", bare, "--data", data, "-o", tmp_path / "c.yaml")
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "has no chat template" in " ".join(result.output.split())


# ---- the plan: grouped batches, graphs counted, the limit, padding as init says ---------------

WORDS = "the river city train report night garden letter music storm".split()


def short_model(tmp_path: Path, positions: int = 200) -> Path:
    """The tiny Llama with fewer positions: a prompt gets positions - 128 (init's new tokens)."""
    folder = tmp_path / f"tiny-{positions}"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config,
                                                    "max_position_embeddings": positions}))
    return folder


def varied_prompts(path: Path, n: int = 48, seed: int = 0, bad: bool = True) -> list[str]:
    """n prompts of long-tailed lengths (a few past 72 tokens), in no order of length, and
    (bad) three lines the run rejects: not JSON, a number for a prompt, no prompt field."""
    rng = np.random.default_rng(seed)
    words = np.minimum(rng.pareto(1.2, n) * 6 + 1, 150).astype(int)
    lines = [json.dumps({"id": f"q{i}", "prompt": " ".join(rng.choice(WORDS, k))})
             for i, k in enumerate(words)]
    if bad:
        lines[5:5] = ["{not json"]
        lines[20:20] = [json.dumps({"id": "num", "prompt": 7})]
        lines[33:33] = [json.dumps({"id": "none", "text": "no prompt here"})]
    path.write_text("\n".join(lines) + "\n")
    return lines


def expected_padding(output: str) -> float:
    """The prefills' padding init printed, as a fraction."""
    said = " ".join(output.split())
    found = re.search(r"buckets.seq planned for the prefills, which pack the prompts: (\d+)% "
                      r"of their positions padding expected \(simulated", said)
    assert found, said
    return int(found.group(1)) / 100


def test_batch_needs_cover_the_next_few_records():
    """The planned need of a batch is the longest of its records and the next slack ones, so
    a record the run rejects and the sample did not (every later cut of the window moves by
    one) leaves each batch within the prompt length planned for it."""
    from graphrun.init.generate import slack
    from graphrun.init.text import batch_shapes

    assert (slack(4), slack(32), slack(64)) == (1, 2, 4)
    lengths = np.array([9] * 7 + [40] + [9] * 4)
    # in file order, batches of 4: the 40 is the second batch's, and the first's next record
    assert [s[1] for s in batch_shapes(lengths, 4, None)] == [9, 40, 9]
    assert [s[1] for s in batch_shapes(lengths, 4, None, slack=1)] == [9, 40, 9]
    assert [s[1] for s in batch_shapes(lengths, 4, None, slack=4)] == [40, 40, 9]
    assert [s[0] for s in batch_shapes(lengths, 4, None, slack=4)] == [4, 4, 4]  # own rows
    rng = np.random.default_rng(3)
    window = rng.integers(1, 300, 61)
    planned = [s[1] for s in batch_shapes(window, 8, 61, slack=slack(8))]
    for dropped in range(len(window)):
        shifted = batch_shapes(np.delete(window, dropped), 8, 61)
        assert all(s[1] <= need for s, need in zip(shifted, planned)), dropped


def test_buckets_are_planned_for_the_grouped_batches_within_the_graph_bound(tmp_path):
    from graphrun.plan.generation import GRAPHS, graphs_of

    data = tmp_path / "prompts.jsonl"
    varied_prompts(data)
    folder = short_model(tmp_path)
    result, spec_path = init(tmp_path, folder, data=data)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(spec_path)
    seq, batch = spec.buckets["seq"], spec.buckets["batch"]
    # 48 prompts and 3 bad lines in one window, batches of 8: no other size is ever selected
    assert spec.data.group_by_length == 51
    assert batch == [8]
    # the longest prompts are cut at the limit: 200 positions less 128 new tokens
    # a longer prompt is rejected with its line unless the user sets truncate (the default)
    assert seq[-1] == 72 and spec.data.text.truncate is False and max(seq) <= 72
    assert all(v % 8 == 0 for v in seq) and len(seq) > 1
    graphs = graphs_of(spec.buckets, 128)
    assert graphs.total <= GRAPHS and graphs.prefill == len(seq)
    said = " ".join(result.output.split())
    assert f"buckets: {graphs.total} graphs ({graphs.prefill} prefill, {graphs.decode} decode" \
        in said
    assert f"graphs: {graphs.prefill} prefill + {graphs.decode} decode" in spec_path.read_text()
    # the prefills' padding said is the one their simulation gives for the lists written, and
    # less than a plain power-of-two list's
    from graphrun.plan.generation import prefill_evaluation
    from graphrun.plan.planner import histogram

    # the sample's prompts as init plans them: a longer one cut at the limit
    hist = histogram(graphrun.load_spec(spec_path, ["data.text.truncate=true"]))
    said_padding = expected_padding(result.output)
    assert said_padding == pytest.approx(prefill_evaluation(hist, spec.buckets,
                                                            spec.generate)[0].waste, abs=0.02)
    plain = {**spec.buckets, "seq": [8, 16, 32, 64, 72]}
    assert said_padding < prefill_evaluation(hist, plain, spec.generate)[0].waste


def test_a_sample_of_the_whole_file_with_bad_lines_needs_no_bucket_at_the_limit(tmp_path):
    """Every line read, the bad ones too (the run rejects them as well): no prompt the sample
    did not see can come, so the last bucket is the longest prompt's and a longer one would be
    rejected, not cut."""
    data = tmp_path / "prompts.jsonl"
    write_prompts(data)
    with open(data, "a") as f:
        f.write("{not json\n" + json.dumps({"id": "n", "prompt": 7}) + "\n")
    folder = short_model(tmp_path, 300)  # prompts of 3-113 tokens; 172 positions left
    result, spec_path = init(tmp_path, folder, data=data)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(spec_path)
    assert spec.buckets["seq"][-1] == 120 and spec.data.text.truncate is False
    assert "the sample is the whole file, so a longer text is rejected" in result.output
    result, spec_path = init(tmp_path, folder, "--sample", 10, "--force", data=data)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(spec_path)  # a part of the file: the limit, past it rejected
    assert spec.buckets["seq"][-1] == 168 and spec.data.text.truncate is False


def test_the_written_spec_runs_and_pads_as_init_said(tmp_path):
    """The spec init writes runs on the CPU (bad lines skipped, few new tokens so the test is
    quick: the prompt buckets do not change), and its prompt padding, in the manifest, is the
    padding init printed."""
    data = tmp_path / "prompts.jsonl"
    lines = varied_prompts(data)
    folder = short_model(tmp_path)
    result, spec_path = init(tmp_path, folder, data=data)
    assert result.exit_code == 0, result.output
    expected_padding(result.output)
    out = tmp_path / "out"
    sets = ["data.on_bad_record=skip", "generate.max_new_tokens=3", "generate.min_new_tokens=3",
            "data.text.truncate=true"]
    run = cli("run", spec_path, "--out", out, *[a for x in sets for a in ("--set", x)])
    assert run.exit_code == 0, run.output
    manifest = json.loads((out / "manifest.json").read_text())
    totals = manifest["totals"]
    assert (totals["records_in"], totals["records_out"], totals["records_rejected"]) == (
        len(lines), len(lines) - 3, 3)
    assert totals["texts_truncated"] >= 1  # the long tail, cut from the left at 72 tokens
    # the prefills are those the planner simulates for these prompts, in the order the run
    # takes them, every completion max_new_tokens long
    from graphrun.plan.planner import histogram
    from graphrun.plan.prefills import Admission, simulated, waste

    spec = graphrun.load_spec(spec_path, sets)
    admission = Admission.of(spec.generate, spec.buckets, "batch", "seq")
    packs = simulated(histogram(spec).prompts, admission)[0]
    gen = manifest["generation"]
    assert gen["prefills"] == len(packs) and gen["prefill_positions"] == sum(
        v for v in [min(x for x in spec.buckets["seq"] if x >= p) for p in packs])
    assert gen["prefill_padding"] == pytest.approx(waste([packs], spec.buckets["seq"],
                                                         admission.budget))
    used = {b["sizes"]["batch"] for b in manifest["buckets"] if b["batches"]}
    assert used and max(used) <= max(spec.buckets["batch"])  # parts of the batch size
    # slots: auto on the CPU: the largest batch bucket, its decode graphs the batch list's
    gen = manifest["generation"]
    assert spec.generate.slots == "auto" and gen["slots"] == max(spec.buckets["batch"])
    decode = sorted(x["size"] for x in gen["graphs"] if x["kind"] == "decode")
    assert decode == sorted(spec.buckets["batch"])
    # graphrun's Llama loads the folder: its kernels' warm-up begun, a no-op without CUDA
    assert (gen["warm_up"]["status"], gen["warm_up"]["reason"]) == ("skipped", "no CUDA device")
    rows = []
    for part in sorted(out.glob("part-*.jsonl")):
        rows += [json.loads(line) for line in part.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"q{i}" for i in range(len(lines) - 3)]  # input order
    assert max(r["prompt_tokens"] for r in rows) <= 72


def test_the_graphs_counted_are_the_ones_the_engine_sets_up():
    """plan/generation.py counts graphs as the engine makes them: a prefill graph per seq value
    and a decode graph per batch value, every one set up before the first prompt, and no other
    however long the records run."""
    import torch

    from graphrun.generate.config import GenerateConfig
    from graphrun.generate.engine import Engine
    from graphrun.models.causal.llama import build_llama
    from graphrun.plan.generation import graphs_of

    lists = {"batch": [2, 4], "seq": [8, 24, 40]}
    new = 20
    engine = Engine(build_llama(max_len=64, vocab=64), config=GenerateConfig(max_new_tokens=new),
                    slots=4, max_prompt=40, rows=lists["batch"], prompts=lists["seq"],
                    device="cpu", dtype=torch.float32, backend="eager")
    counted = graphs_of(lists, new)
    assert len(engine.table.entries) == counted.total == 5
    for n, longest in [(4, 20), (1, 5), (3, 33)]:
        engine.generate([[3] * longest] * n)
    assert len(engine.table.entries) == counted.total


def test_plan_on_a_generation_spec_counts_its_graphs_and_stops_at_the_positions_left(tmp_path):
    data = tmp_path / "prompts.jsonl"
    varied_prompts(data, n=60, seed=1, bad=False)
    folder = short_model(tmp_path)
    result, spec_path = init(tmp_path, folder, data=data)
    assert result.exit_code == 0, result.output
    for new, room in ((128, 72), (64, 136)):
        planned = cli("plan", spec_path, "--set", f"generate.max_new_tokens={new}",
                      "--set", f"data.text.max_length={room + 50}", "--max-graphs", 24,
                      "--set", "data.text.truncate=true")
        assert planned.exit_code == 0, planned.output
        said = " ".join(planned.output.split())
        assert (f"seq stops at {room}: the model's 200 positions (config.json's "
                f"max_position_embeddings) less generate.max_new_tokens ({new})") in said
        lists = yaml_lists(planned.output)
        assert max(lists["seq"]) == room  # texts are cut there: the plan covers them
        graphs = int(re.search(r"graphs, planned: (\d+) graphs", said).group(1))
        assert graphs <= 24
        padding = re.search(r"padding expected in the prefills, which pack the prompts "
                            r"\(simulated, .*\): ([\d.]+)% of their positions with the spec "
                            r"lists, ([\d.]+)% planned", said)
        assert padding and float(padding.group(2)) <= float(padding.group(1)), said
    wrote = cli("plan", spec_path, "--write")
    assert wrote.exit_code == 0, wrote.output
    spec = graphrun.load_spec(spec_path)
    from graphrun.plan.generation import GRAPHS, graphs_of

    graphs = graphs_of(spec.buckets, 128)
    assert graphs.total <= GRAPHS and max(spec.buckets["seq"]) <= 72
    assert f"graphs: {graphs.prefill} prefill + {graphs.decode} decode" in spec_path.read_text()
    assert f"8, or {GRAPHS} for a generation spec" in " ".join(
        cli("plan", "--help").output.split())


def yaml_lists(output: str) -> dict:
    import yaml

    return yaml.safe_load(output[output.rindex("buckets:"):])["buckets"]


def test_a_huge_outlier_is_planned_around_and_every_bad_record_is_named(tmp_path):
    """One prompt of thousands of tokens among short ones: the buckets are planned for the
    rest, and the outlier is rejected past the largest (data.text.max_length), said with its line;
    every bad line of the sample is named with its reason."""
    data = tmp_path / "messy.jsonl"
    lines = varied_prompts(data, n=120, bad=False)
    lines[60] = json.dumps({"id": "huge", "prompt": " ".join(["river city"] * 3000)})
    for k in (10, 30, 50, 70, 90, 110):
        lines[k] = '{"id": "cut%d", "prompt": "not closed' % k
    data.write_text("\n".join(lines) + "\n")
    result, spec_path = init(tmp_path, TINY, data=data)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    spec = graphrun.load_spec(spec_path)
    seq = spec.buckets["seq"]
    # a generation spec rejects a prompt over the limit unless truncate is set: said so
    assert seq[-1] < 896 and spec.data.text.max_length == seq[-1]
    assert not spec.data.text.truncate
    assert re.search(rf"1 text far longer than the rest, messy.jsonl:61 \([\d,]+ tokens\), was "
                     rf"planned without: data.text.max_length {seq[-1]} rejects such a text "
                     r"with its line", said)
    assert "6 records of the sample could not be used" in said
    for k in (10, 30, 50, 70, 90, 110):
        assert (f"messy.jsonl:{k + 1}: invalid JSON: the string opened at column "
                in said), k
    assert cli("validate", spec_path).exit_code == 0


# ---- prompts of token ids: planned from their own lengths, taken as they are ------------------

def write_ids(path: Path, lengths, field: str = "input_ids", extra=None, seed: int = 0
              ) -> list[list[int]]:
    """One record per length, its prompt `length` token ids of the tiny Llama's vocabulary
    (512), none its BOS (0) or EOS (1); extra(i): more fields of record i."""
    rng = np.random.default_rng(seed)
    prompts = [[int(x) for x in rng.integers(2, 512, n)] for n in lengths]
    path.write_text("".join(json.dumps({"id": f"t{i}", field: p, **(extra(i) if extra else {})})
                            + "\n" for i, p in enumerate(prompts)))
    return prompts


ID_LENGTHS = [17, 3, 40, 9, 26, 5, 33, 12, 38, 21, 7, 29, 15, 36, 4, 24, 11, 31, 19, 8]


def test_a_file_of_token_ids_is_planned_from_their_lengths_and_runs(tmp_path):
    """Records whose prompt is a list of token ids: data.text.field names that field, the
    prompt buckets are planned from the ids' own counts (no special token added), and the
    written spec runs, one completion per record whose prompt_tokens is its ids' count."""
    import yaml

    data = tmp_path / "ids.jsonl"
    prompts = write_ids(data, ID_LENGTHS)
    result, spec_path = init(tmp_path, TINY, data=data)
    assert result.exit_code == 0, result.output
    written = yaml.safe_load(spec_path.read_text())
    assert written["data"]["text"] == {"field": "input_ids", "truncate": False}
    assert "the prompt's token ids, taken as they are" in spec_path.read_text()
    spec = graphrun.load_spec(spec_path)
    assert spec.data.text.field == "input_ids" and spec.generate is not None
    said = " ".join(result.output.split())
    assert "data.text: field 'input_ids' holds token ids, taken as they are" in said
    assert "read 20 records of ids.jsonl (of 20)" in said
    # planned from the counts 3..40 as they are: a BOS added, or the ids' text tokenized
    # again, would make them other lengths
    assert "token lengths 3-40 in the 20 records sampled" in said
    assert "prompt tokens 3-40 in the sample" in spec_path.read_text()
    seq = spec.buckets["seq"]
    assert seq[-1] == 40 and seq == sorted(seq) and all(v % 8 == 0 for v in seq)
    assert len(seq) > 1 and seq[0] < 40  # the short ones get buckets of their own
    # 20 records in one window, batches of 8: 8, 8 and 4
    assert spec.buckets["batch"] == [4, 8] and spec.data.group_by_length == 20
    out = tmp_path / "out"
    run = cli("run", spec_path, "--out", out, "--set", "generate.max_new_tokens=2",
              "--set", "generate.min_new_tokens=2")
    assert run.exit_code == 0, run.output
    totals = json.loads((out / "manifest.json").read_text())["totals"]
    assert (totals["records_in"], totals["records_out"], totals["records_rejected"]) == (
        20, 20, 0)
    rows = [json.loads(x) for part in sorted(out.glob("part-*.jsonl"))
            for x in part.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"t{i}" for i in range(20)]  # one each, in input order
    assert [r["prompt_tokens"] for r in rows] == [len(p) for p in prompts] == ID_LENGTHS
    assert all(r["output_tokens"] == 2 and len(r["token_ids"]) == 2 for r in rows)


def test_a_file_whose_every_prompt_is_past_the_vocabulary_writes_no_spec(tmp_path):
    """Every sampled record's token ids past the model's 512: init planned buckets from them,
    wrote the spec and exited 0, listing all of them as records `run` rejects."""
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps({"id": i, "input_ids": [600 + i, 3]}) + "\n"
                            for i in range(5)))
    result, spec_path = init(tmp_path, TINY, data=data)
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert (f"error: {data}: no record of the sample could be used (5 read); the first: "
            "ids.jsonl:1: input_ids: token id 600 is past the model's vocabulary (512 ids")\
        in said, said
    assert not spec_path.exists()


def token_count(text: str) -> int:
    """A text's tokens as init counts them: the tiny Llama's tokenizer, special tokens added."""
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(TINY / "tokenizer.json")).encode(text).ids)


def test_a_text_prompt_beside_token_ids_is_the_prompt(tmp_path):
    """A record with a prompt field of text and a field of token ids: the text is the prompt,
    and the buckets are planned from its token lengths, not the ids'."""
    data = tmp_path / "both.jsonl"
    texts = [" ".join(WORDS[: 1 + i % 4]) for i in range(len(ID_LENGTHS))]
    write_ids(data, ID_LENGTHS, extra=lambda i: {"prompt": texts[i]})
    result, spec_path = init(tmp_path, TINY, data=data)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(spec_path)
    assert spec.data.text.field == "prompt" and spec.data.text.add_special_tokens is True
    lo, hi = min(map(token_count, texts)), max(map(token_count, texts))
    assert hi < 16  # far from the ids' 40
    said = " ".join(result.output.split())
    assert "data.text: field 'prompt', tokenized by the model's tokenizer" in said
    assert f"token lengths {lo}-{hi} in the 20 records sampled" in said
    assert spec.buckets["seq"][-1] == -(-hi // 8) * 8


def test_token_ids_named_so_are_the_prompt_beside_a_string_field_named_otherwise(tmp_path):
    """A field of token ids named as such (input_ids) beside a string field whose name is no
    prompt's (a language): the ids are the prompt, the string field said to be unused;
    --text-field picks the string field all the same."""
    data = tmp_path / "meta.jsonl"
    write_ids(data, ID_LENGTHS, extra=lambda i: {"lang": "en"})
    result, spec_path = init(tmp_path, TINY, data=data)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(spec_path)
    assert spec.data.text.field == "input_ids" and spec.buckets["seq"][-1] == 40
    said = " ".join(result.output.split())
    assert "token lengths 3-40" in said and "string fields not used: lang" in said
    result, spec_path = init(tmp_path, TINY, "--text-field", "lang", "--force", data=data)
    assert result.exit_code == 0, result.output
    assert graphrun.load_spec(spec_path).data.text.field == "lang"


def test_two_fields_of_token_ids_named_neither_way_ask_for_text_field(tmp_path):
    """Two unnamed fields of whole-number lists: which holds the prompts is asked, not
    guessed; --text-field names it, and its lengths plan the buckets."""
    data = tmp_path / "two.jsonl"
    write_ids(data, ID_LENGTHS, field="a", extra=lambda i: {"b": [5, 6, 7]})
    result, spec_path = init(tmp_path, TINY, data=data)
    assert result.exit_code != 0 and "Traceback" not in result.output
    said = " ".join(result.output.split())
    assert "holds several fields of whole numbers (a, b)" in said
    assert "pass --text-field for the one holding the prompts' token ids" in said
    assert not spec_path.exists()
    result, spec_path = init(tmp_path, TINY, "--text-field", "a", data=data)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(spec_path)
    assert spec.data.text.field == "a" and spec.buckets["seq"][-1] == 40
    assert "token lengths 3-40" in " ".join(result.output.split())


def test_token_ids_for_a_job_other_than_generation_is_one_message(tmp_path):
    """Prompts of token ids are a generation job's: --task next-token on a causal LM is
    refused with one message saying to use --task generate; an encoder (embed), which cannot
    generate, is told the file holds no text, not sent to --task generate; a causal LM without
    --task writes the generation job."""
    from tests.test_init_hf import save_model

    data = tmp_path / "ids.jsonl"
    write_ids(data, ID_LENGTHS)
    refused = [
        (TINY, ("--task", "next-token"), "ids.jsonl holds prompts of token ids (field "
         "'input_ids'), which a generation job reads: use --task generate"),
        (save_model(tmp_path / "bert", "embed"), (), "ids.jsonl holds no text field: field "
         "'input_ids' holds prompts of token ids, which only a generation job over a causal "
         "LM reads; --hf's embed tokenizes a text field")]
    for folder, extra, message in refused:
        spec_path = tmp_path / "x.yaml"
        result = cli("init", "--hf", folder, "--data", data, "-o", spec_path, *extra)
        assert result.exit_code != 0 and "Traceback" not in result.output, folder
        said = " ".join(result.output.split())
        assert message in said, said
        assert not spec_path.exists()
    assert "--task generate" not in said  # the encoder's: no generation job for it
    result = cli("init", "--hf", TINY, "--data", data, "-o", tmp_path / "auto.yaml")
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(tmp_path / "auto.yaml")
    assert spec.generate is not None and spec.data.text.field == "input_ids"


def test_a_prompt_field_of_text_and_token_ids_names_its_bad_lists_as_the_run_does(tmp_path):
    """A prompt field holding text in some records and token ids in others: init plans from
    both, and the sampled lists a run rejects are named with the run's reason, not as
    "expected a string"."""
    data = tmp_path / "mixed.jsonl"
    rows = [{"id": f"m{i}", "prompt": " ".join(WORDS[: 1 + i % 4])} for i in range(12)]
    rows += [{"id": "ids", "prompt": list(range(2, 30))}, {"id": "empty", "prompt": []},
             {"id": "half", "prompt": [1.5, 2]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result, spec_path = init(tmp_path, TINY, data=data)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "mixed.jsonl:14: prompt: an empty list of token ids; give at least one" in said
    assert "mixed.jsonl:15: prompt: expected a string or a list of token ids (whole numbers " \
           ">= 0), got 1.5 at place 0 in the list" in said
    assert "expected a string, got" not in said
    assert graphrun.load_spec(spec_path).buckets["seq"][-1] == 32  # the 28 ids, planned
