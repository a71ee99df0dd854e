"""OpenAI Batch files in and out (data.format / output.format openai_batch), and per-record
parameters (generate.per_record): every request answered by one line in input order, in the
Batch API's output shape; each request graphrun cannot serve an error line and a reject with
why, never served with its parameters dropped."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

import graphrun
from graphrun.read.openai_batch import body_params
from graphrun.read.requests import params_from_fields
from graphrun.spec.request import REQUEST_FIELD, RequestParams
from tests.test_chat import CHATS, chat_model, hf_chat_greedy, rows

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import check_openai_batch  # noqa: E402

NEW = 5
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def request(cid: str, body: dict, url: str = CHAT) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("m") / "tiny-chat")


@pytest.fixture(scope="module")
def hf(model_dir):
    transformers = pytest.importorskip("transformers")
    return (transformers.AutoTokenizer.from_pretrained(model_dir),
            transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval())


def write_batch(tmp_path: Path, lines: list, model: Path, **spec_over) -> tuple[Path, Path]:
    """A requests file (dicts as JSON lines, strings as they are) and a spec of model, data and
    output alone, plus spec_over's sections."""
    path = tmp_path / "requests.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    spec = {"version": 1, "name": "batch", "device": "cpu",
            "model": {"hf": {"path": str(model), "class": "AutoModelForCausalLM"},
                      "dtype": "float32"},
            "data": {"path": str(path), "format": "openai_batch", "on_bad_record": "skip"},
            "output": {"dir": str(tmp_path / "out")}, **spec_over}
    out = tmp_path / "batch.yaml"
    out.write_text(yaml.safe_dump(spec))
    return out, path


def test_a_chat_batch_file_is_answered_line_by_line_in_the_batch_output_shape(tmp_path,
                                                                              model_dir, hf):
    lines = [request("a", {"model": "tiny", "messages": CHATS[0], "max_tokens": NEW,
                           "temperature": 0}),
             request("b", {"messages": CHATS[1], "max_completion_tokens": NEW, "seed": 7}),
             "{not json",
             request("c", {"messages": CHATS[2]}, url="/v1/embeddings"),
             request("d", {"messages": CHATS[0], "presence_penalty": 0.5}),
             request("e", {"messages": CHATS[0], "n": 3}),
             request("f", {"messages": CHATS[0], "logprobs": True, "top_logprobs": 5}),
             request("g", {"messages": CHATS[0], "stop": ["\n"]}),
             request("h", {"messages": CHATS[0], "max_tokens": NEW + 5}),
             request("i", {"messages": CHATS[0], "temperature": "hot"}),
             request("j", {"prompt": "hello"}, url=COMPLETIONS),
             request("k", {"messages": CHATS[2], "frequency_penalty": 0, "stream": False}),
             request("m", {"messages": CHATS[1], "max_tokens": 2}),
             request("a", {"messages": CHATS[1]})]
    spec, path = write_batch(tmp_path, lines, model_dir,
                             generate={"max_new_tokens": NEW})
    loaded = graphrun.load_spec(spec)
    assert loaded.buckets == {"batch": "auto", "seq": "auto"}
    assert loaded.output.format == "openai_batch" and loaded.data.id_field == "custom_id"
    manifest = graphrun.run(loaded)
    out = rows(tmp_path / "out")
    requests = check_openai_batch.read_lines(str(path), strict=False)
    assert check_openai_batch.check(requests, out) == []
    assert [x["custom_id"] for x in out] == ["a", "b", None, "c", "d", "e", "f", "g", "h", "i",
                                             "j", "k", "m", "a"]
    assert len({x["id"] for x in out}) == len(out)  # a repeated custom_id's line too
    served = {x["custom_id"]: x for x in out if x["error"] is None}
    assert sorted(served) == ["a", "b", "k", "m"]
    for cid, messages in (("a", CHATS[0]), ("b", CHATS[1]), ("k", CHATS[2])):
        prompt, want = hf_chat_greedy(hf, messages)
        body = served[cid]["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == hf[0].decode(
            want, skip_special_tokens=True)
        assert body["usage"]["prompt_tokens"] == len(prompt)
        assert body["usage"]["completion_tokens"] == len(want)
    # a request's own max_tokens, under the job's cap, is served on its row
    prompt, want = hf_chat_greedy(hf, CHATS[1])
    short = served["m"]["response"]["body"]
    assert short["usage"]["completion_tokens"] == min(2, len(want))
    assert short["choices"][0]["message"]["content"] == hf[0].decode(
        want[:2], skip_special_tokens=True)
    errors = {x["custom_id"]: x["error"]["message"] for x in out if x["error"] is not None}
    assert "invalid JSON" in errors[None] and "requests.jsonl:3" in errors[None]
    assert "/v1/embeddings" in errors["c"]
    assert "presence_penalty" in errors["d"]
    assert "n > 1" in errors["e"]
    assert "logprobs" in errors["f"]
    assert "stop" in errors["g"]
    assert f"max_new_tokens {NEW + 5} is more than the job's cap" in errors["h"]
    assert "temperature" in errors["i"]
    assert "one endpoint" in errors["j"]
    assert "duplicate" in out[-1]["error"]["message"]
    assert manifest.totals.records_out == 4 and manifest.totals.records_rejected == 10
    rejects = (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()
    assert len(rejects) == 10


def test_a_completions_batch_file_tokenizes_its_prompts_with_special_tokens(tmp_path,
                                                                            model_dir, hf):
    import torch

    lines = [request(f"p{i}", {"prompt": text, "max_tokens": NEW}, url=COMPLETIONS)
             for i, text in enumerate(["An old fisherman", "The committee described"])]
    spec, path = write_batch(tmp_path, lines, model_dir, generate={"max_new_tokens": NEW})
    graphrun.run(graphrun.load_spec(spec))
    out = rows(tmp_path / "out")
    assert check_openai_batch.check(check_openai_batch.read_lines(str(path), False), out) == []
    tok, lm = hf
    for line, req in zip(out, lines):
        ids = tok(req["body"]["prompt"], return_tensors="pt").input_ids
        with torch.no_grad():
            new = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                              do_sample=False)[0, ids.shape[1]:].tolist()
        body = line["response"]["body"]
        assert body["object"] == "text_completion"
        assert body["choices"][0]["text"] == tok.decode(new, skip_special_tokens=True)
        assert body["usage"]["prompt_tokens"] == ids.shape[1]


def test_rejected_requests_after_the_last_served_one_still_get_their_lines(tmp_path,
                                                                           model_dir):
    lines = [request("a", {"messages": CHATS[0]}), request("b", {"messages": CHATS[0], "n": 2}),
             request("c", {"messages": "no"})]
    spec, path = write_batch(tmp_path, lines, model_dir, generate={"max_new_tokens": 2})
    graphrun.run(graphrun.load_spec(spec))
    out = rows(tmp_path / "out")
    assert [x["custom_id"] for x in out] == ["a", "b", "c"]
    assert [x["error"] is None for x in out] == [True, False, False]


@pytest.mark.parametrize("body,why", [
    ({"messages": [], "top_logprobs": 3}, "needs logprobs: true"),
    ({"messages": [], "max_tokens": 0}, "max_tokens: 0 is not a whole number >= 1"),
    ({"messages": [], "max_tokens": 4, "max_completion_tokens": 5}, "differ"),
    ({"messages": [], "top_p": 0}, "top_p: 0 is not a number in (0, 1]"),
    ({"messages": [], "stop": ["a", "b", "c", "d", "e"]}, "up to 4"),
    ({"messages": [], "tools": [{"type": "function"}]}, "body.tools"),
    ({"messages": [], "guided_json": {}}, "not a parameter graphrun serves"),
    ({"prompt": "x"}, "no 'messages'"),
    ({"messages": [], "stop_token_ids": [-1]}, "not a list of token ids"),
    ({"messages": [], "logit_bias": {"5": 1}}, "body.logit_bias"),
])
def test_a_request_body_with_a_bad_or_unserved_value_says_why(body, why):
    got = body_params(body, chat=True)
    assert isinstance(got, str) and why in got


def test_a_request_body_becomes_its_request_params():
    got = body_params({"messages": [], "max_tokens": 9, "temperature": 0.5, "top_p": 0.9,
                       "seed": 3, "stop": "END", "n": 2, "logprobs": True, "top_logprobs": 4,
                       "top_k": -1, "user": "u1", "presence_penalty": 0}, chat=True)
    assert got == RequestParams(max_new_tokens=9, temperature=0.5, top_p=0.9, seed=3,
                                stop_strings=("END",), n=2, logprobs=4)
    assert body_params({"prompt": "x", "logprobs": 2}, chat=False) == RequestParams(logprobs=2)
    assert body_params({"messages": [], "stop_token_ids": [2, 7], "logit_bias": {}},
                       chat=True) == RequestParams(stop_token_ids=(2, 7))


def per_record_job(tmp_path: Path, records: list[dict], model: Path, per_record: dict,
                   **generate) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = {"version": 1, "name": "per", "device": "cpu",
            "model": {"hf": {"path": str(model), "class": "AutoModelForCausalLM"},
                      "dtype": "float32"},
            "data": {"path": str(path), "id_field": "id", "text": {"field": "prompt"},
                     "on_bad_record": "skip", "batch_size": 2},
            "generate": {"max_new_tokens": 4, "per_record": per_record, **generate},
            "output": {"dir": str(tmp_path / "out")}}
    out = tmp_path / "per.yaml"
    out.write_text(yaml.safe_dump(spec))
    return out


def test_per_record_values_are_checked_record_by_record(tmp_path, model_dir):
    records = [{"id": "same", "prompt": "a", "max_tokens": 4, "temp": 0},
               {"id": "none", "prompt": "b"},
               {"id": "longer", "prompt": "c", "max_tokens": 8},
               {"id": "bad", "prompt": "d", "max_tokens": "many"},
               {"id": "hot", "prompt": "e", "temp": 0.7},
               {"id": "neg", "prompt": "f", "temp": -1},
               {"id": "short", "prompt": "g", "max_tokens": 2}]
    spec = per_record_job(tmp_path, records, model_dir,
                          {"max_new_tokens": "max_tokens", "temperature": "temp"})
    manifest = graphrun.run(graphrun.load_spec(spec))
    out = {r["id"]: r for r in rows(tmp_path / "out")}
    assert list(out) == ["same", "none", "hot", "short"]  # each served on its own row
    assert out["short"]["output_tokens"] <= 2
    rejects = {json.loads(x)["id"]: json.loads(x) for x in
               (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()}
    assert "max_new_tokens 8 is more than the job's cap" in rejects["longer"]["reason"]
    assert "max_tokens (generate.per_record.max_new_tokens): 'many'" in rejects["bad"]["reason"]
    assert rejects["bad"]["where"].endswith("prompts.jsonl:4")
    assert "temp (generate.per_record.temperature): -1" in rejects["neg"]["reason"]
    assert manifest.totals.records_rejected == 3


@pytest.mark.parametrize("workers", [0, 2], ids=["here", "children"])
def test_per_record_params_ride_with_each_record_to_the_engine(tmp_path, model_dir, workers):
    from graphrun.base.tuning import Tuning
    from graphrun.generate.records import with_implied_io
    from graphrun.read.stream import read_batches

    records = [{"id": i, "prompt": f"prompt number {i}", "seed": i} for i in range(40)]
    spec = per_record_job(tmp_path, records, model_dir, {"seed": "seed"})
    raw = yaml.safe_load(spec.read_text())
    raw["buckets"] = {"batch": [1, 2], "seq": [64]}
    raw["data"]["group_by_length"] = 8  # batches sorted by length: the params move along
    spec.write_text(yaml.safe_dump(raw))
    spec = with_implied_io(graphrun.load_spec(spec))
    tuning = Tuning(jsonl_workers=workers, jsonl_workers_min_bytes=0, jsonl_chunk_bytes=512,
                    text_threads=0)
    batches = [b for b in read_batches(spec, tuning=tuning) if len(b)]
    got = sorted((i, p.seed) for b in batches for i, p in zip(b.ids, b.fields[REQUEST_FIELD]))
    assert got == [(i, i) for i in range(40)]  # greedy: any seed is served, and carried


def test_params_from_fields_reads_each_named_field():
    got = params_from_fields({"mt": 3, "s": ["x"], "k": None},
                             {"max_new_tokens": "mt", "stop": "s", "top_k": "k"})
    assert got == RequestParams(max_new_tokens=3, stop_strings=("x",))


def batch_outputs(idx: list[int]) -> dict:
    import numpy as np

    return {"token_ids": [np.array([i, i + 1], np.int64) for i in idx],
            "text": np.array([f"answer {i}" for i in idx]),
            "finish_reason": np.array(["eos" if i % 2 else "length" for i in idx]),
            "prompt_tokens": np.array([10 + i for i in idx], np.int64),
            "output_tokens": np.array([2] * len(idx), np.int64)}


def write_batch_shards(spec, out: Path, rejected: set[int], n: int, resume=None, start=0,
                       stop_after=None) -> "ShardWriter":
    import numpy as np

    from graphrun.write.shards import ShardWriter

    w = ShardWriter(spec, out, resume=resume)
    for k, b in enumerate(range(start, n, 5)):  # batches of 5: rejects first, then the rows
        if stop_after is not None and k == stop_after:
            return w
        span = range(b, min(b + 5, n))
        for i in span:
            if i in rejected:
                w.reject(i, f"r{i}", f"requests.jsonl:{i + 1}", f"request {i} is bad")
        good = [i for i in span if i not in rejected]
        if good:
            w.write(np.array(good), [f"r{i}" for i in good], batch_outputs(good), batch_start=b)
    return w


def shard_lines(out: Path) -> list[dict]:
    lines = rows(out)
    for x in lines:  # the time a line was written: the one field a rerun changes
        if x["response"]["body"]:
            x["response"]["body"].pop("created")
    return lines


def test_error_lines_take_their_places_across_shards_and_after_a_resume(tmp_path, model_dir):
    from graphrun.generate.records import with_implied_io
    from graphrun.write.shards import prepare_out_dir

    spec, _ = write_batch(tmp_path, [request("x", {"messages": CHATS[0]})], model_dir,
                          buckets={"batch": [1, 4], "seq": [64]})
    spec = graphrun.load_spec(spec)
    spec.output.rows_per_file = 2
    spec = with_implied_io(spec)
    fp = {"spec_sha256": "a" * 64, "input_sha256": "b" * 64, "shards": ["jsonl"]}
    n, rejected = 17, {0, 3, 4, 8, 14, 15, 16}  # the first, runs, and the last three
    whole = tmp_path / "whole"
    prepare_out_dir(whole, resume=False, overwrite=False, fingerprint=fp)
    write_batch_shards(spec, whole, rejected, n).close()
    got = shard_lines(whole)
    assert [x["custom_id"] for x in got] == [f"r{i}" for i in range(n)]  # one each, in order
    assert [x["error"] is not None for x in got] == [i in rejected for i in range(n)]
    assert got[1]["response"]["body"]["choices"][0] == {
        "index": 0, "message": {"role": "assistant", "content": "answer 1"}, "logprobs": None,
        "finish_reason": "stop"}
    assert "request 3 is bad (requests.jsonl:4)" == got[3]["error"]["message"]
    requests = [{"custom_id": f"r{i}", "url": CHAT} for i in range(n)]
    assert check_openai_batch.check(requests, rows(whole)) == []
    assert len((whole / "rejects.jsonl").read_text().splitlines()) == len(rejected)

    crashed = tmp_path / "crashed"
    prepare_out_dir(crashed, resume=False, overwrite=False, fingerprint=fp)
    dead = write_batch_shards(spec, crashed, rejected, n, stop_after=2)
    dead.wait_for_commits()  # then killed
    point = prepare_out_dir(crashed, resume=True, overwrite=False, fingerprint=fp)
    write_batch_shards(spec, crashed, rejected, n, resume=point, start=point.start).close()
    assert shard_lines(crashed) == got
    assert (crashed / "rejects.jsonl").read_text() == (whole / "rejects.jsonl").read_text()


def test_runner_on_a_generation_spec_says_what_to_use(tmp_path, model_dir):
    spec, _ = write_batch(tmp_path, [request("x", {"messages": CHATS[0]})], model_dir)
    with pytest.raises(graphrun.SpecError, match=r"graphrun.run\(spec\)"):
        graphrun.Runner(graphrun.load_spec(spec))


def test_parquet_chat_records_carry_their_per_record_fields(tmp_path, model_dir, hf):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "chats.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"],
                             "messages": [CHATS[0], CHATS[2], CHATS[0]],
                             "mt": [4, None, 9]}), path)
    spec = {"version": 1, "name": "pq", "device": "cpu",
            "model": {"hf": {"path": str(model_dir), "class": "AutoModelForCausalLM"},
                      "dtype": "float32"},
            "data": {"path": str(path), "id_field": "id", "chat": {}, "on_bad_record": "skip"},
            "generate": {"max_new_tokens": 4, "per_record": {"max_new_tokens": "mt"}},
            "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "pq.yaml").write_text(yaml.safe_dump(spec))
    manifest = graphrun.run(graphrun.load_spec(tmp_path / "pq.yaml"))
    got = rows(tmp_path / "out")
    assert [r["id"] for r in got] == ["a", "b"]
    for row, messages in zip(got, (CHATS[0], CHATS[2])):
        prompt, want = hf_chat_greedy(hf, messages)
        assert row["prompt_tokens"] == len(prompt) and row["token_ids"] == want[:4]
    (reject,) = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text()
                 .splitlines()]
    assert reject["id"] == "c" and "max_new_tokens 9 is more than the job's cap" in reject["reason"]
    assert manifest.totals.records_rejected == 1


def test_model_data_and_output_alone_run_a_batch_file(tmp_path, model_dir):
    lines = [request("a", {"messages": CHATS[0]}), request("b", {"messages": CHATS[1],
                                                                  "temperature": 0})]
    spec, path = write_batch(tmp_path, lines, model_dir)
    raw = yaml.safe_load(spec.read_text())
    assert set(raw) == {"version", "name", "device", "model", "data", "output"}
    manifest = graphrun.run(graphrun.load_spec(spec))
    out = rows(tmp_path / "out")
    assert check_openai_batch.check(check_openai_batch.read_lines(str(path), False), out) == []
    assert manifest.totals.records_out == 2
    assert all(0 < x["response"]["body"]["usage"]["completion_tokens"] <= 128 for x in out)


def test_a_per_record_field_given_twice_in_a_line_rejects_it(tmp_path, model_dir):
    spec = per_record_job(tmp_path, [{"id": "b", "prompt": "x", "mt": 4}], model_dir,
                          {"max_new_tokens": "mt"})
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "prompt": "x", "mt": 9, "mt": 4}\n' + path.read_text())
    graphrun.run(graphrun.load_spec(spec))
    assert [r["id"] for r in rows(tmp_path / "out")] == ["b"]
    (reject,) = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text()
                 .splitlines()]
    assert "'mt' appears more than once" in reject["reason"]


def test_validate_finds_the_chat_template_missing_as_run_would(tmp_path, model_dir):
    # the file's endpoint is its first served request's url, in the spec's checks as in run:
    # a first line to an unserved url (rejected) does not hide the chat requests after it
    folder = tmp_path / "no-template"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("chat_template.jinja", "chat_template.json"):
        (folder / name).unlink(missing_ok=True)
    lines = [request("x", {"input": "hi"}, url="/v1/embeddings"),
             request("a", {"messages": CHATS[0]})]
    spec, _ = write_batch(tmp_path, lines, folder)
    with pytest.raises(graphrun.SpecError, match="has no chat template"):
        graphrun.load_spec(spec)
