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
import torch
import yaml
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main
from graphrun.generate.token_bytes import logprob_text
from graphrun.read.openai_batch import body_params
from graphrun.read.requests import params_from_fields
from graphrun.spec.request import REQUEST_FIELD, RequestParams
from tests.test_chat import CHATS, hf, hf_chat_greedy, model_dir, rows  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import check_openai_batch  # noqa: E402

NEW = 5
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def request(cid: str, body: dict, url: str = CHAT) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}




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
    assert sorted(served) == ["a", "b", "d", "e", "f", "g", "k", "m"]
    assert len(served["e"]["response"]["body"]["choices"]) == 3  # n: a choice per sample
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
    # logprobs: true with top_logprobs 5, in chat's shape, the model's own log_softmax
    prompt, want = hf_chat_greedy(hf, CHATS[0])
    choice = served["f"]["response"]["body"]["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(want) and choice["logprobs"]["refusal"] is None
    with torch.no_grad():
        logits = hf[1](torch.tensor([prompt + want])).logits[0, len(prompt) - 1:-1]
    expected = logits.float().log_softmax(-1)
    # the tokens' own bytes, joined, are the completion's text (a part of a character too)
    raw = bytes(b for entry in content for b in entry["bytes"])
    assert raw.decode("utf-8", errors="replace") == hf[0].decode(want)
    for j, (entry, token) in enumerate(zip(content, want)):
        assert entry["token"] == logprob_text(bytes(entry["bytes"]))
        assert abs(entry["logprob"] - float(expected[j, token])) < 1e-4
        tops = entry["top_logprobs"]
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert len(tops) == 5 and tops[0]["logprob"] == entry["logprob"]  # greedy: the best
    assert served["a"]["response"]["body"]["choices"][0]["logprobs"] is None  # not asked
    # presence_penalty 0.5: served on its row
    assert served["d"]["response"]["body"]["usage"]["completion_tokens"] >= 1
    errors = {x["custom_id"]: x["error"]["message"] for x in out if x["error"] is not None}
    assert "invalid JSON" in errors[None] and "requests.jsonl:3" in errors[None]
    assert "/v1/embeddings" in errors["c"]
    assert f"max_new_tokens {NEW + 5} is more than the job's cap" in errors["h"]
    assert "temperature" in errors["i"]
    assert "one endpoint" in errors["j"]
    assert "duplicate" in out[-1]["error"]["message"]
    assert manifest.totals.records_out == 8 and manifest.totals.records_rejected == 6
    rejects = (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()
    assert len(rejects) == 6


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


def test_a_completions_prompt_given_as_a_list_of_one_is_that_prompt(tmp_path, model_dir):
    lines = [request("text", {"prompt": "An old fisherman", "max_tokens": 3}, url=COMPLETIONS),
             request("one", {"prompt": ["An old fisherman"], "max_tokens": 3}, url=COMPLETIONS),
             request("ids", {"prompt": [[5, 6, 7]], "max_tokens": 3}, url=COMPLETIONS),
             request("two", {"prompt": ["a", "b"]}, url=COMPLETIONS),
             request("none", {"prompt": []}, url=COMPLETIONS)]
    spec, path = write_batch(tmp_path, lines, model_dir, generate={"max_new_tokens": 3})
    graphrun.run(graphrun.load_spec(spec))
    out = {x["custom_id"]: x for x in rows(tmp_path / "out")}
    assert out["one"]["response"]["body"]["choices"] == out["text"]["response"]["body"][
        "choices"]
    assert out["ids"]["response"]["body"]["usage"]["prompt_tokens"] == 3
    assert "several prompts is not served" in out["two"]["error"]["message"]
    assert "an empty list" in out["none"]["error"]["message"]


def test_rejected_requests_after_the_last_served_one_still_get_their_lines(tmp_path,
                                                                           model_dir):
    lines = [request("a", {"messages": CHATS[0]}),
             request("b", {"messages": CHATS[0], "tools": [{"type": "function"}]}),
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
    ({"messages": [], "logprobs": "yes"}, 'body.logprobs: "yes" is not true or false'),
])
def test_a_request_body_with_a_bad_or_unserved_value_says_why(body, why):
    got = body_params(body, chat=True)
    assert isinstance(got, str) and why in got


def test_a_completions_requests_logprobs_is_shown_as_the_file_holds_it():
    got = body_params({"prompt": "x", "logprobs": True}, chat=False)
    assert "body.logprobs: true is not a whole number in [0, 5]" in got


def test_a_request_body_becomes_its_request_params():
    got = body_params({"messages": [], "max_tokens": 9, "temperature": 0.5, "top_p": 0.9,
                       "seed": 3, "stop": "END", "n": 2, "logprobs": True, "top_logprobs": 4,
                       "top_k": -1, "user": "u1", "presence_penalty": 0.5,
                       "frequency_penalty": -1, "repetition_penalty": 1.2}, chat=True)
    assert got == RequestParams(max_new_tokens=9, temperature=0.5, top_p=0.9, seed=3,
                                stop_strings=("END",), n=2, logprobs=4, presence_penalty=0.5,
                                frequency_penalty=-1.0, repetition_penalty=1.2)
    assert body_params({"prompt": "x", "logprobs": 2}, chat=False) == RequestParams(logprobs=2)
    assert body_params({"messages": [], "stop_token_ids": [2, 7], "logit_bias": {}},
                       chat=True) == RequestParams(stop_token_ids=(2, 7))


def test_a_whole_number_written_as_a_float_counts_as_that_number_in_a_per_record_field():
    named = {"max_new_tokens": "mt", "seed": "s", "top_k": "k", "n": "n", "logprobs": "lp"}
    got = params_from_fields({"mt": 16.0, "s": -3.0, "k": 0.0, "n": 2.0, "lp": 5.0}, named)
    assert got == RequestParams(max_new_tokens=16, seed=-3, top_k=0, n=2, logprobs=5)
    assert type(got.max_new_tokens) is int and type(got.seed) is int
    for record, why in (({"mt": 2.5}, "mt (generate.per_record.max_new_tokens): 2.5 is not"),
                        ({"s": float(2 ** 60)}, "s (generate.per_record.seed): 1.15"),
                        ({"mt": float("nan")}, "mt (generate.per_record.max_new_tokens): NaN"),
                        ({"mt": 0.0}, "mt (generate.per_record.max_new_tokens): 0 is not")):
        assert why in params_from_fields(record, named)


def test_a_parquet_column_of_max_tokens_with_nulls_is_served_record_by_record(tmp_path,
                                                                             model_dir):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    spec = per_record_job(tmp_path, [{"id": "x", "prompt": "a"}], model_dir,
                          {"max_new_tokens": "max_tokens"})
    table = pa.table({"id": ["short", "spec", "shorter"], "prompt": ["g", "g", "g"],
                      "max_tokens": pa.array([2.0, None, 1.0], pa.float64())})
    pq.write_table(table, tmp_path / "prompts.parquet")
    raw = yaml.safe_load(spec.read_text())
    raw["data"]["path"] = str(tmp_path / "prompts.parquet")
    spec.write_text(yaml.safe_dump(raw))
    manifest = graphrun.run(graphrun.load_spec(spec))
    out = {r["id"]: r for r in rows(tmp_path / "out")}
    assert [out[k]["output_tokens"] for k in ("short", "spec", "shorter")] == [2, 4, 1]
    assert out["short"]["token_ids"] == out["spec"]["token_ids"][:2]
    assert manifest.totals.records_rejected == 0


def test_a_parquet_file_without_a_mapped_parameters_column_takes_the_specs_value(
        tmp_path, model_dir):
    """A column generate.per_record names but the file lacks is every record's absent field,
    as in JSONL: the spec's value, with the run's warning; the text's own column stays
    required."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    spec = per_record_job(tmp_path, [{"id": "x", "prompt": "a"}], model_dir,
                          {"max_new_tokens": "max_tokens"})
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["g", "h"]}),
                   tmp_path / "prompts.parquet")
    raw = yaml.safe_load(spec.read_text())
    raw["data"]["path"] = str(tmp_path / "prompts.parquet")
    spec.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(main, ["run", str(spec)])
    assert result.exit_code == 0, result.output
    assert "reads field 'max_tokens', which none of the first records holds" in result.output
    assert [r["output_tokens"] for r in rows(tmp_path / "out")] == [4, 4]
    pq.write_table(pa.table({"id": ["a"], "text": ["g"]}), tmp_path / "prompts.parquet")
    result = CliRunner().invoke(main, ["run", str(spec), "--overwrite"])
    assert result.exit_code != 0 and "column 'prompt' is missing" in result.output


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
               {"id": "short", "prompt": "g", "max_tokens": 2},
               {"id": "whole", "prompt": "g"}]
    spec = per_record_job(tmp_path, records, model_dir,
                          {"max_new_tokens": "max_tokens", "temperature": "temp"})
    manifest = graphrun.run(graphrun.load_spec(spec))
    out = {r["id"]: r for r in rows(tmp_path / "out")}
    assert list(out) == ["same", "none", "hot", "short", "whole"]  # each on its own row
    # the same prompt with its own max_tokens 2: the spec's completion cut there
    whole = out["whole"]["token_ids"]
    assert len(whole) > 2  # so that a limit ignored would show
    assert out["short"]["token_ids"] == whole[:2] and out["short"]["output_tokens"] == 2
    rejects = {json.loads(x)["id"]: json.loads(x) for x in
               (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()}
    assert "max_new_tokens 8 is more than the job's cap" in rejects["longer"]["reason"]
    assert "max_tokens (generate.per_record.max_new_tokens): \"many\"" in rejects["bad"]["reason"]
    assert rejects["bad"]["where"].endswith("prompts.jsonl:4")
    assert "temp (generate.per_record.temperature): -1" in rejects["neg"]["reason"]
    assert manifest.totals.records_rejected == manifest.generation.prompts_rejected == 3


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


@pytest.mark.parametrize("neighbour", [None, '{"id": "nan", "prompt": "x", "seed": NaN}'])
def test_a_seed_or_id_past_64_bits_reads_the_same_whatever_its_block_holds(tmp_path, model_dir,
                                                                           neighbour):
    """A whole number past 64 bits is read as the int it is, whether its block is parsed at
    once or line by line (a NaN elsewhere in it): orjson would read it as a float."""
    from graphrun.generate.records import with_implied_io
    from graphrun.read.stream import read_batches

    records = [{"id": "big", "prompt": "a", "seed": 2**70},
               {"id": "low", "prompt": "b", "seed": -2**63 - 1},
               {"id": 2**70, "prompt": "c", "seed": 1}]
    spec = per_record_job(tmp_path, records, model_dir, {"seed": "seed"})
    path = tmp_path / "prompts.jsonl"
    if neighbour:
        path.write_text(path.read_text() + neighbour + "\n")
    raw = yaml.safe_load(spec.read_text())
    raw["buckets"] = {"batch": [1, 2], "seq": [64]}
    spec.write_text(yaml.safe_dump(raw))
    batches = list(read_batches(with_implied_io(graphrun.load_spec(spec))))
    got = [(i, p.seed) for b in batches if len(b)
           for i, p in zip(b.ids, b.fields[REQUEST_FIELD])]
    assert got == [("big", 2**70), ("low", -2**63 - 1), (2**70, 1)]
    assert [r.id for b in batches for r in b.rejects] == (["nan"] if neighbour else [])


def test_params_from_fields_reads_each_named_field():
    got = params_from_fields({"mt": 3, "s": ["x"], "k": None},
                             {"max_new_tokens": "mt", "stop": "s", "top_k": "k"})
    assert got == RequestParams(max_new_tokens=3, stop_strings=("x",))
    named = {"repetition_penalty": "rp", "presence_penalty": "pp", "frequency_penalty": "fp",
             "logprobs": "lp", "min_p": "mp"}
    got = params_from_fields({"rp": 1.2, "pp": -1, "fp": 0.5, "lp": 3, "mp": 0.1}, named)
    assert got == RequestParams(repetition_penalty=1.2, presence_penalty=-1.0,
                                frequency_penalty=0.5, logprobs=3, min_p=0.1)
    for record, why in (({"rp": 0}, "rp (generate.per_record.repetition_penalty): 0 is not"),
                        ({"pp": 2.5}, "pp (generate.per_record.presence_penalty): 2.5 is not"),
                        ({"lp": 21}, "lp (generate.per_record.logprobs): 21 is not a whole "
                                     "number in [0, 20]"),
                        ({"lp": True}, "lp (generate.per_record.logprobs): true is not")):
        assert why in params_from_fields(record, named)


def batch_outputs(idx: list[int]) -> dict:
    import numpy as np

    return {"token_ids": [np.array([i, i + 1], np.int64) for i in idx],
            "text": np.array([f"answer {i}" for i in idx]),
            "finish_reason": np.array(["eos" if i % 2 else "length" for i in idx]),
            "prompt_tokens": np.array([10 + i for i in idx], np.int64),
            "output_tokens": np.array([2] * len(idx), np.int64),
            # an OpenAI Batch job's logprob outputs: empty where a request asked none
            "logprobs": [np.zeros(0, np.float32) for _ in idx],
            "tokens": [np.zeros(0, str) for _ in idx],
            "top_token_ids": [np.zeros((0, 0), np.int64) for _ in idx],
            "top_logprobs": [np.zeros((0, 0), np.float32) for _ in idx],
            "top_tokens": [np.zeros((0, 0), str) for _ in idx],
            "samples": np.array([[{"token_ids": [i, i + 1], "text": f"answer {i}",
                                   "finish_reason": "eos" if i % 2 else "length",
                                   "output_tokens": 2}] for i in idx] + [None],
                                dtype=object)[:-1]}


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


def cut_at_stop(tok, want: list[int], stop: str) -> tuple[str, int, str]:
    """The reference for a stop string: transformers' greedy tokens up to the one whose text
    first holds it -> (the text before it, those tokens' count, finish reason)."""
    for k in range(1, len(want) + 1):
        if stop in tok.decode(want[:k], skip_special_tokens=True):
            text = tok.decode(want, skip_special_tokens=True)
            return text[:text.index(stop)], k, "stop"
    return tok.decode(want, skip_special_tokens=True), len(want), "length"


def middle(text: str) -> str:
    """Two characters from the middle of a completion's text: a stop string it reaches."""
    at = len(text) // 2
    return text[at:at + 2]


def test_a_batch_file_with_n_samples_and_stop_strings_validates_and_cuts_the_text(tmp_path,
                                                                                model_dir, hf):
    tok = hf[0]
    _, want0 = hf_chat_greedy(hf, CHATS[0])
    _, want1 = hf_chat_greedy(hf, CHATS[1])
    stop0, stop1 = middle(tok.decode(want0, skip_special_tokens=True)), middle(
        tok.decode(want1, skip_special_tokens=True))
    lines = [request("s", {"messages": CHATS[0], "stop": stop0}),
             request("n", {"messages": CHATS[2], "n": 3, "temperature": 2.0, "seed": 5}),
             request("both", {"messages": CHATS[1], "n": 3, "stop": ["\x00", stop1]}),
             request("bad", {"messages": CHATS[0], "stop": ["a"] * 5})]
    spec, path = write_batch(tmp_path, lines, model_dir, generate={"max_new_tokens": NEW})
    manifest = graphrun.run(graphrun.load_spec(spec))
    out = rows(tmp_path / "out")
    assert check_openai_batch.check(check_openai_batch.read_lines(str(path), False), out) == []
    body = {x["custom_id"]: x["response"]["body"] for x in out}
    text, k, reason = cut_at_stop(tok, want0, stop0)
    assert reason == "stop" and k < len(want0)
    choice = body["s"]["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (text, "stop")
    assert body["s"]["usage"]["completion_tokens"] == k
    sampled = [c["message"]["content"] for c in body["n"]["choices"]]
    assert [c["index"] for c in body["n"]["choices"]] == [0, 1, 2]
    assert len(set(sampled)) > 1  # each sample its own stream
    text, k, _ = cut_at_stop(tok, want1, stop1)  # greedy: three equal samples, each cut
    assert [c["message"]["content"] for c in body["both"]["choices"]] == [text] * 3
    assert body["both"]["usage"]["completion_tokens"] == 3 * k
    assert "up to 4" in out[3]["error"]["message"]
    assert manifest.generation.finish_reasons["stop"] == 4


def test_per_record_and_spec_stop_strings_cut_jsonl_records(tmp_path, model_dir, hf):
    tok = hf[0]
    prompts = ["the fisherman", "a storm came"]
    want = [hf_plain_greedy(hf, p) for p in prompts]
    own = middle(tok.decode(want[1], skip_special_tokens=True))
    spec_stop = middle(tok.decode(want[0], skip_special_tokens=True))
    records = [{"id": "spec", "prompt": prompts[0]}, {"id": "own", "prompt": prompts[1],
                                                      "halt": own}]
    spec = per_record_job(tmp_path, records, model_dir, {"stop": "halt"},
                          stop={"strings": [spec_stop]})
    graphrun.run(graphrun.load_spec(spec))
    out = {r["id"]: r for r in rows(tmp_path / "out")}
    for rid, w in (("spec", want[0]), ("own", want[1])):
        stops = [spec_stop] if rid == "spec" else [spec_stop, own]
        ref = min((cut_at_stop(tok, w, s) for s in stops),
                  key=lambda r: (r[1], r[2] != "stop"))
        got = out[rid]
        assert (got["text"], got["output_tokens"], got["finish_reason"]) == ref
        assert got["token_ids"] == w[:ref[1]]


def hf_plain_greedy(hf, prompt: str) -> list[int]:
    """transformers' greedy new ids of a plain prompt, as the engine tokenizes it."""
    import torch

    tok, lm = hf
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                          do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_n_above_one_outside_the_batch_output_format_is_refused_with_what_to_set(tmp_path,
                                                                                model_dir):
    spec = per_record_job(tmp_path, [{"id": "a", "prompt": "x", "k": 2},
                                     {"id": "b", "prompt": "y", "k": 1}], model_dir, {"n": "k"})
    graphrun.run(graphrun.load_spec(spec))
    assert [r["id"] for r in rows(tmp_path / "out")] == ["b"]
    reject = json.loads((tmp_path / "out" / "rejects.jsonl").read_text())
    assert "output.format: openai_batch" in reject["reason"]
    raw = yaml.safe_load(spec.read_text())
    raw["generate"]["n"] = 2
    spec.write_text(yaml.safe_dump(raw))
    with pytest.raises(Exception, match="generate.n"):
        graphrun.load_spec(spec)


def test_the_checker_counts_a_lines_choices_against_its_requests_n():
    choice = {"index": 0, "message": {"role": "assistant", "content": "x"}, "logprobs": None,
              "finish_reason": "stop"}
    body = {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [choice, {**choice, "index": 1}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
    line = {"id": "l", "custom_id": "a", "error": None,
            "response": {"status_code": 200, "request_id": "r", "body": body}}
    asked = [request("a", {"messages": CHATS[0], "n": 2})]
    assert check_openai_batch.check(asked, [line]) == []
    plain_request = [request("a", {"messages": CHATS[0]})]
    assert check_openai_batch.check(plain_request, [line]) == ["line 1: 2 choices for n 1"]
    assert check_openai_batch.check(plain_request, [line], default_n=2) == []


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


def test_a_last_shard_of_only_rejected_requests_resumes(tmp_path):
    """The shipped batch's last request is rejected: with 5 rows a shard its error line is a
    shard of no rows. --resume of the completed run, and of one killed before its manifest,
    goes on from the journal instead of refusing it as not graphrun's."""
    spec, out = str(ROOT / "pipelines" / "openai-batch.yaml"), tmp_path / "o"
    args = ["run", spec, "-q", "--set", "output.rows_per_file=5", "--out", str(out)]
    assert CliRunner().invoke(main, args).exit_code == 0
    lines = {p.name: p.read_bytes() for p in out.glob("part-*.jsonl")}
    assert len(lines) == 2 and lines["part-00001.jsonl"].count(b"\n") == 1
    result = CliRunner().invoke(main, [*args, "--resume"])
    assert result.exit_code == 0 and "already complete" in result.output, result.output
    (out / "manifest.json").unlink()  # killed after the last journal line, before the manifest
    result = CliRunner().invoke(main, [*args, "--resume"])
    assert result.exit_code == 0, result.output
    assert {p.name: p.read_bytes() for p in out.glob("part-*.jsonl")} == lines
