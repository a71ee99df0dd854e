"""Records that carry their own generation parameters (max_tokens, temperature, stop, n):
`graphrun init --hf` maps them to generate.per_record (a field absent from or null in some
records is no bad record), raises the job's cap on new tokens to cover them, names each record
whose value the run rejects with the run's own reason, and leaves unmapped a field named as a
parameter whose values are none; `graphrun run` over a spec that does not read such fields
says so, instead of giving every record the spec's value without a word."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main
from graphrun.init.sample import sample_data

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or
    importlib.util.find_spec("tokenizers") is None,
    reason="needs transformers and tokenizers (the hf extra)")

TINY = Path(__file__).resolve().parent.parent / "examples" / "models" / "tiny-llama"
WORDS = "the river city train report night garden letter music storm".split()


def cli(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def prompt(i: int) -> str:
    return " ".join(WORDS[: 2 + i % 8])


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def outputs(spec) -> dict:
    folder = Path(spec.output.dir)
    rows = [json.loads(x) for f in sorted(folder.glob("part-*.jsonl"))
            for x in f.read_text().splitlines()]
    return {r["id"]: r for r in rows}


def init_then_run(data: Path):
    """`graphrun init --task generate` on data (2 new tokens), then the spec it wrote run with
    data.on_bad_record: skip: (what init printed, on one line; the spec; the manifest)."""
    spec_path = data.parent / "gen.yaml"
    result = cli("init", "--hf", TINY, "--data", data, "-o", spec_path, "--task", "generate",
                 "--max-new-tokens", 2)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(spec_path, ["data.on_bad_record=skip"])
    return " ".join(result.output.split()), spec, graphrun.run(spec)


def test_records_own_parameters_are_mapped_and_served_record_by_record(tmp_path):
    """Fields absent from or null in some records, a metadata field in a few: every record
    is sampled and none is named bad; the spec reads max_tokens, temperature and stop per
    record, its cap covers the largest max_tokens, and the run serves each record's own."""
    rows = []
    for i in range(16):
        row = {"id": f"p{i}", "prompt": prompt(i)}
        if i % 4 != 3:  # absent from every fourth record
            row["max_tokens"] = None if i % 5 == 0 else 1 + i % 6
        if i % 3 == 0:
            row["temperature"] = [0, 0.7, None][i % 9 // 3]
        if i == 6:
            row["stop"] = ["river", "city"]
        if i in (2, 9):
            row["source"] = {"kind": "web"}
        rows.append(row)
    rows[11]["max_tokens"] = 150  # past the default cap of 128
    data = write(tmp_path / "p.jsonl", rows)
    spec_path = tmp_path / "gen.yaml"
    result = cli("init", "--hf", TINY, "--data", data, "-o", spec_path, "--batch-size", 8)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "read 16 records of p.jsonl" in said and "left out" not in said
    assert ("generate.per_record: each record's own max_tokens (max_new_tokens), temperature, "
            "stop; a record without one (or null) takes the spec's value; max_new_tokens 150 "
            "covers the records' own") in said
    spec = graphrun.load_spec(spec_path)
    assert spec.generate.per_record.fields == {"max_new_tokens": "max_tokens",
                                               "temperature": "temperature", "stop": "stop"}
    assert spec.generate.max_new_tokens == 150 and spec.output.format == "jsonl"
    m = graphrun.run(spec)
    assert (m.totals.records_out, m.totals.records_rejected) == (16, 0)
    assert not any("per_record" in w for w in m.warnings)  # every parameter field is read
    got = outputs(spec)
    for row in rows:
        out = got[row["id"]]
        cap = row.get("max_tokens") or 150
        assert out["output_tokens"] <= cap, (row, out)
        if out["finish_reason"] == "length":
            assert out["output_tokens"] == cap, (row, out)
    assert got["p11"]["output_tokens"] > 128 or got["p11"]["finish_reason"] == "eos"


def test_a_value_the_run_rejects_is_named_by_init_as_the_run_names_it(tmp_path):
    rows = [{"id": f"p{i}", "prompt": prompt(i), "max_tokens": 2 + i % 3,
             "temperature": 0.5} for i in range(20)]
    rows[4]["max_tokens"] = 0
    rows[9]["temperature"] = "hot"
    rows[13]["prompt"] = None  # a bad prompt is named once, for its prompt
    rows[13]["max_tokens"] = -3
    data = write(tmp_path / "p.jsonl", rows)
    spec_path = tmp_path / "gen.yaml"
    result = cli("init", "--hf", TINY, "--data", data, "-o", spec_path, "--task", "generate")
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    spec = graphrun.load_spec(spec_path, ["data.on_bad_record=skip"])
    assert spec.generate.per_record.fields == {"max_new_tokens": "max_tokens",
                                               "temperature": "temperature"}
    m = graphrun.run(spec)
    assert (m.totals.records_out, m.totals.records_rejected) == (17, 3)
    rejects = [json.loads(x) for x in (spec.output.dir / "rejects.jsonl").read_text().splitlines()]
    assert [r["where"] for r in rejects] == ["p.jsonl:5", "p.jsonl:10", "p.jsonl:14"]
    for r in rejects:  # init named each, as the run did, and each once
        assert said.count(f"{r['where']}: ") == 1 and f"{r['where']}: {r['reason']}" in said
    assert "max_tokens (generate.per_record.max_new_tokens): 0 is not a whole number" in said


def test_a_field_named_as_a_parameter_whose_values_are_none_is_not_read(tmp_path):
    """OpenAI's chat requests write logprobs as a boolean: no count of alternatives, so the
    field is left unmapped (and said), not every record rejected."""
    rows = [{"id": f"p{i}", "prompt": prompt(i), "logprobs": True, "seed": i}
            for i in range(10)]
    data = write(tmp_path / "p.jsonl", rows)
    spec_path = tmp_path / "gen.yaml"
    result = cli("init", "--hf", TINY, "--data", data, "-o", spec_path, "--task", "generate")
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert ("field 'logprobs' is not read as each record's logprobs (generate.per_record): "
            "10 of the 10 values sampled are none, e.g. logprobs: true is not a whole number "
            "in [0, 20]") in said
    assert "left out" not in said
    assert graphrun.load_spec(spec_path).generate.per_record.fields == {"seed": "seed"}


def test_a_record_asking_for_several_samples_makes_the_output_openai_batch(tmp_path):
    rows = [{"id": f"p{i}", "prompt": prompt(i), "n": 1 + (i == 3)} for i in range(6)]
    data = write(tmp_path / "p.jsonl", rows)
    spec_path = tmp_path / "gen.yaml"
    result = cli("init", "--hf", TINY, "--data", data, "-o", spec_path, "--task", "generate",
                 "--max-new-tokens", 3, "--temperature", 1, "--seed", 0)
    assert result.exit_code == 0, result.output
    assert "output.format openai_batch: a record asking for n > 1 samples" in " ".join(
        result.output.split())
    spec = graphrun.load_spec(spec_path)
    assert spec.output.format == "openai_batch" and spec.generate.per_record.n == "n"
    m = graphrun.run(spec)
    assert (m.totals.records_out, m.totals.records_rejected) == (6, 0)
    lines = [json.loads(x) for f in sorted(Path(spec.output.dir).glob("part-*"))
             for x in f.read_text().splitlines()]
    choices = {x["custom_id"]: len(x["response"]["body"]["choices"]) for x in lines}
    assert choices == {f"p{i}": 1 + (i == 3) for i in range(6)}


def test_a_parquet_file_with_nulls_in_its_parameter_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    n = 12
    table = pa.table({"id": [f"p{i}" for i in range(n)], "prompt": [prompt(i) for i in range(n)],
                      "max_tokens": [None if i % 3 == 0 else 1 + i % 4 for i in range(n)]})
    pq.write_table(table, tmp_path / "p.parquet")
    spec_path = tmp_path / "gen.yaml"
    result = cli("init", "--hf", TINY, "--data", tmp_path / "p.parquet", "-o", spec_path,
                 "--task", "generate", "--max-new-tokens", 5)
    assert result.exit_code == 0, result.output
    assert "left out" not in result.output
    spec = graphrun.load_spec(spec_path)
    assert spec.generate.per_record.fields == {"max_new_tokens": "max_tokens"}
    graphrun.run(spec)
    for i, (rid, out) in enumerate(sorted(outputs(spec).items(), key=lambda x: int(x[0][1:]))):
        cap = 5 if i % 3 == 0 else 1 + i % 4
        ended = out["finish_reason"], out["output_tokens"]
        assert ended == ("length", cap) or (ended[0] == "eos" and ended[1] <= cap), (rid, out)


def test_a_run_whose_spec_does_not_read_the_records_parameters_says_so(tmp_path):
    rows = [{"id": f"p{i}", "prompt": prompt(i), "max_tokens": 2, "temperature": 0.3}
            for i in range(4)]
    data = write(tmp_path / "p.jsonl", rows)
    spec_path = tmp_path / "gen.yaml"
    assert cli("init", "--hf", TINY, "--data", data, "-o", spec_path, "--task", "generate",
               "--max-new-tokens", 3).exit_code == 0
    text = spec_path.read_text()
    spec_path.write_text("\n".join(x for x in text.splitlines() if "per_record" not in x))
    m = graphrun.run(graphrun.load_spec(spec_path))
    said = " ".join(" ".join(m.warnings).split())
    assert ("the records hold 'max_tokens', 'temperature', named as generation parameters "
            "that the spec does not read: every record gets the spec's value") in said
    assert "per_record: {max_new_tokens: max_tokens, temperature: temperature}" in said
    mapped = graphrun.load_spec(spec_path, ["generate.per_record.max_new_tokens=max_tokens"])
    said = " ".join(graphrun.run(mapped, overwrite=True).warnings)
    assert "'temperature'" in said and "'max_tokens'" not in said


def test_text_records_may_differ_in_their_fields(tmp_path):
    """The sample of a text file keeps a record whose fields differ from the first record's
    (the run reads only the fields the spec names); a numeric file's record still may not."""
    data = write(tmp_path / "t.jsonl", [{"id": "a", "text": "one"},
                                        {"id": "b", "text": "two", "lang": "en"},
                                        {"id": "c", "text": None}])
    profile = sample_data(data, 100, text=True)
    assert profile.sampled == 3 and profile.skipped == []
    assert profile.values["lang"] == [None, "en", None]
    assert profile.texts["text"] == ["one", "two", None]
    numbers = write(tmp_path / "n.jsonl", [{"x": [1, 2]}, {"x": [3, 4], "y": 1}, {"x": [5, 6]}])
    profile = sample_data(numbers, 100)
    assert profile.sampled == 2 and "differ from the first record's" in profile.skipped[0]


def test_a_per_record_field_the_records_lack_is_said_with_the_one_they_hold(tmp_path):
    rows = [{"id": f"p{i}", "prompt": prompt(i), "max_tokens": 2} for i in range(3)]
    data = write(tmp_path / "p.jsonl", rows)
    spec_path = tmp_path / "gen.yaml"
    assert cli("init", "--hf", TINY, "--data", data, "-o", spec_path, "--task", "generate",
               "--max-new-tokens", 3).exit_code == 0
    spec = graphrun.load_spec(spec_path, ["generate.per_record.max_new_tokens=max_token"])
    said = " ".join(" ".join(graphrun.run(spec).warnings).split())
    assert ("generate.per_record.max_new_tokens reads field 'max_token', which none of the "
            "first records holds, so they get the spec's value; they hold 'max_tokens', which "
            "may be it") in said


def test_a_batch_file_s_max_tokens_raise_the_cap_and_refused_requests_are_named(tmp_path):
    """A Batch request asking for more tokens than init's default cap is served (the cap
    covers it), and each request the run answers with an error line is named by init with
    the run's reason."""
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "m", "prompt": prompt(i), "max_tokens": 3}} for i in range(8)]
    rows[2]["body"]["max_tokens"] = 140
    rows[5]["body"]["top_p"] = 7
    rows[6]["url"] = "/v1/embeddings"
    data = write(tmp_path / "requests.jsonl", rows)
    spec_path = tmp_path / "batch.yaml"
    result = cli("init", "--hf", TINY, "--data", data, "-o", spec_path)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "generate.max_new_tokens 140 covers the requests' own max_tokens" in said
    spec = graphrun.load_spec(spec_path)
    assert spec.generate.max_new_tokens == 140 and spec.data.format == "openai_batch"
    graphrun.run(spec)
    lines = [json.loads(x) for f in sorted(Path(spec.output.dir).glob("part-*"))
             for x in f.read_text().splitlines()]
    refused = {x["custom_id"]: x["error"]["message"] for x in lines if x.get("error")}
    assert sorted(refused) == ["r5", "r6"]
    for rid, message in refused.items():  # "reason (file:line)", as init named it
        reason, where = message.rsplit(" (", 1)
        assert f"{where.rstrip(')')}: {reason}" in said


def test_a_record_without_the_prompt_field_or_an_id_or_with_a_repeated_one_is_named(tmp_path):
    rows = [{"id": f"p{i}", "prompt": prompt(i)} for i in range(8)]
    rows[2] = {"id": "p2", "promt": "the river"}  # a typo'd field, not a null one
    rows[5] = {"prompt": "the city"}  # no id
    rows[7]["id"] = "p6"  # a repeated id: rejected, the first one kept
    said, spec, m = init_then_run(write(tmp_path / "p.jsonl", rows))
    assert (m.totals.records_out, m.totals.records_rejected) == (5, 3)
    rejects = [json.loads(x) for x in (spec.output.dir / "rejects.jsonl").read_text().splitlines()]
    assert [r["where"] for r in rejects] == ["p.jsonl:3", "p.jsonl:6", "p.jsonl:8"]
    for r in rejects:
        assert f"{r['where']}: {r['reason']}" in said


def chat(i: int) -> list[dict]:
    return [{"role": "user", "content": prompt(i)}]


@pytest.mark.parametrize("kind", ["batch", "chat", "ids"])
def test_records_the_run_rejects_for_their_messages_or_token_ids_are_named_by_init(tmp_path,
                                                                                  kind):
    """A Batch request or chat record whose messages the run rejects (a role missing, a
    content not text, none at all, null), and a prompt of token ids past the model's
    vocabulary: init names each with the run's own reason and place."""
    if kind == "batch":
        rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "m", "messages": chat(i), "max_tokens": 2}} for i in range(8)]
        rows[1]["body"]["messages"] = [{"content": "hi"}]
        rows[3]["body"]["messages"] = [{"role": "user", "content": None}]
        rows[6]["body"]["messages"] = []
        bad = ["r1", "r3", "r6"]
    elif kind == "chat":
        rows = [{"id": f"c{i}", "messages": chat(i)} for i in range(8)]
        rows[2]["messages"] = None
        rows[5]["messages"] = [{"role": "robot", "content": "hi"}]
        bad = ["c2", "c5"]
    else:
        rows = [{"id": f"t{i}", "prompt": [1, 5 + i, 9]} for i in range(8)]
        rows[4]["prompt"] = [1, 600]  # the tiny model has 512 ids
        bad = ["t4"]
    said, spec, m = init_then_run(write(tmp_path / "records.jsonl", rows))
    rejects = [json.loads(x) for x in (spec.output.dir / "rejects.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rejects) == bad
    assert m.totals.records_out + m.totals.records_rejected == 8
    for r in rejects:
        assert f"{r['where']}: {r['reason']}" in said
