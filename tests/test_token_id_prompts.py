"""A generation job's prompts given as token ids (a JSONL list, a Parquet list column, a
completions request's prompt): taken as they are, no tokenizer run on them, the same
completions as their text's tokens give; bad ids rejected with their line and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("tokenizers")

import graphrun  # noqa: E402

FOLDER = Path(__file__).resolve().parents[1] / "examples" / "models" / "tiny-llama"
TEXTS = ["The old fisherman", "A storm over the harbour", "Tell me a story"]


def token_ids(text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(FOLDER / "tokenizer.json")).encode(text).ids


def job(tmp_path: Path, data: dict, name: str = "ids", **generate) -> dict:
    spec = {"version": 1, "name": name, "device": "cpu",
            "model": {"hf": {"path": str(FOLDER), "class": "AutoModelForCausalLM"},
                      "dtype": "float32"},
            "data": {"on_bad_record": "skip", **data},
            "generate": {"max_new_tokens": 6, **generate},
            "output": {"dir": str(tmp_path / name)}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    manifest = graphrun.run(graphrun.load_spec(path))
    out = tmp_path / name
    rows = [json.loads(x) for f in sorted(out.glob("part-*.jsonl")) for x in f.read_text().splitlines()]
    rejects = out / "rejects.jsonl"
    return {"manifest": manifest, "rows": rows,
            "rejects": [json.loads(x) for x in rejects.read_text().splitlines()]
            if rejects.exists() else []}


def test_token_id_prompts_complete_as_their_texts_do_and_bad_ids_are_rejected(tmp_path):
    records = []
    for i, text in enumerate(TEXTS):
        records += [{"id": f"t{i}", "prompt": text}, {"id": f"i{i}", "prompt": token_ids(text)}]
    records += [{"id": "empty", "prompt": []}, {"id": "word", "prompt": [1, "a"]},
                {"id": "negative", "prompt": [-1]}, {"id": "past", "prompt": [99999]},
                {"id": "bool", "prompt": [True]}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    got = job(tmp_path, {"path": str(tmp_path / "p.jsonl"), "id_field": "id",
                         "text": {"field": "prompt"}})
    rows = {r["id"]: r for r in got["rows"]}
    assert [r["id"] for r in got["rows"]] == [r["id"] for r in records[:6]]  # input order
    for i in range(len(TEXTS)):
        assert rows[f"i{i}"]["token_ids"] == rows[f"t{i}"]["token_ids"]
        assert rows[f"i{i}"]["prompt_tokens"] == rows[f"t{i}"]["prompt_tokens"] > 0
    why = {r["id"]: r["reason"] for r in got["rejects"]}
    assert why["empty"] == "prompt: an empty list of token ids; give at least one"
    assert 'got "a" at place 1 in the list' in why["word"]
    assert "got -1 at place 0 in the list" in why["negative"]
    assert "got true at place 0 in the list" in why["bool"]
    assert "token id 99999 is past the model's vocabulary (512 ids" in why["past"]
    assert got["rejects"][0]["where"].endswith("p.jsonl:7")


def test_a_parquet_list_column_of_token_ids_and_a_cut_from_the_left(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    ids = [token_ids(t) for t in TEXTS]
    (tmp_path / "p.jsonl").write_text("".join(
        json.dumps({"id": f"r{i}", "prompt": p}) + "\n" for i, p in enumerate(ids)))
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(3)],
                             "prompt": pa.array(ids, pa.list_(pa.int64()))}),
                   tmp_path / "p.parquet")
    text = {"field": "prompt"}
    from_jsonl = job(tmp_path, {"path": str(tmp_path / "p.jsonl"), "id_field": "id",
                                "text": text}, "a")["rows"]
    from_parquet = job(tmp_path, {"path": str(tmp_path / "p.parquet"), "id_field": "id",
                                  "text": text}, "b")["rows"]
    assert [r["token_ids"] for r in from_parquet] == [r["token_ids"] for r in from_jsonl]
    # truncate: true keeps a long prompt's last max_length ids, as it cuts a text's tokens
    cut = job(tmp_path, {"path": str(tmp_path / "p.jsonl"), "id_field": "id",
                         "text": {**text, "truncate": True, "max_length": 4}}, "c")
    assert [r["prompt_tokens"] for r in cut["rows"]] == [4, 4, 4]
    assert cut["manifest"].generation.prompts_truncated == 3
    (tmp_path / "last.jsonl").write_text("".join(
        json.dumps({"id": f"r{i}", "prompt": p[-4:]}) + "\n" for i, p in enumerate(ids)))
    last = job(tmp_path, {"path": str(tmp_path / "last.jsonl"), "id_field": "id",
                          "text": text}, "d")["rows"]
    assert [r["token_ids"] for r in cut["rows"]] == [r["token_ids"] for r in last]


def test_a_completions_request_may_give_its_prompt_as_token_ids(tmp_path):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": p, "max_tokens": 6}}
             for i, p in enumerate([TEXTS[0], token_ids(TEXTS[0])])]
    lines.append({"custom_id": "many", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "m", "prompt": [[1, 2], [3]], "max_tokens": 6}})
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = job(tmp_path, {"path": str(tmp_path / "b.jsonl"), "format": "openai_batch"})
    out = {r["custom_id"]: r for r in got["rows"]}
    texts = [out[c]["response"]["body"]["choices"][0]["text"] for c in ("c0", "c1")]
    assert texts[0] == texts[1]
    assert out["many"]["response"]["status_code"] == 400
    assert "one list of token ids per request" in out["many"]["error"]["message"]


def test_a_builtin_models_vocabulary_bounds_the_ids_given(tmp_path):
    records = [{"id": "ok", "prompt": [5, 6, 7]}, {"id": "past", "prompt": [5, 70]}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = {"version": 1, "name": "b", "device": "cpu",
            "model": {"builtin": "llama", "args": {"vocab": 64}, "dtype": "float32"},
            "data": {"path": str(tmp_path / "p.jsonl"), "id_field": "id",
                     "text": {"field": "prompt", "tokenizer": str(FOLDER)},
                     "on_bad_record": "skip"},
            "generate": {"max_new_tokens": 3}, "output": {"dir": str(tmp_path / "b")}}
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(spec))
    graphrun.run(graphrun.load_spec(tmp_path / "b.yaml"))
    rows = [json.loads(x) for x in (tmp_path / "b" / "part-00000.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["ok"]
    reject = json.loads((tmp_path / "b" / "rejects.jsonl").read_text())
    assert "token id 70 is past the model's vocabulary (64 ids, model.args' vocab)" in reject["reason"]


def test_init_takes_token_id_records_as_prompts_not_as_bad_records(tmp_path):
    from click.testing import CliRunner

    from graphrun.cli.main import main

    records = [{"id": f"t{i}", "prompt": t} for i, t in enumerate(TEXTS)]
    records += [{"id": f"i{i}", "prompt": token_ids(t)} for i, t in enumerate(TEXTS)]
    records.append({"id": "n", "prompt": 5})
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = tmp_path / "gen.yaml"
    said = CliRunner().invoke(main, ["init", "--hf", str(FOLDER), "--data",
                                     str(tmp_path / "p.jsonl"), "--task", "generate",
                                     "--max-new-tokens", "4", "-o", str(spec)])
    assert said.exit_code == 0, said.output
    assert "p.jsonl:7: prompt: expected a string, got a number" in said.output
    assert "p.jsonl:4" not in said.output  # token ids: read by the run, no bad record
    raw = yaml.safe_load(spec.read_text())
    raw["data"]["on_bad_record"] = "skip"
    spec.write_text(yaml.safe_dump(raw))
    manifest = graphrun.run(graphrun.load_spec(spec))
    assert manifest.totals.records_out == 6 and manifest.totals.records_rejected == 1
