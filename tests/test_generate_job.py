"""The generation job end to end on the CPU: `graphrun run` over a JSONL file of prompts and the
shipped tiny Llama folder, checked against transformers' own generate record by record, and the
job's guarantees (input order, bad prompts, truncation, seeded sampling, --resume after kill -9,
--gpus workers)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main
from tests.children import child_env

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "examples" / "models" / "tiny-llama"
PROMPTS = ROOT / "examples" / "data" / "prompts.jsonl"
NEW = 6


def write_prompts(path: Path, n: int, extra: list[str] = ()) -> list[dict]:
    records = [json.loads(line) for line in PROMPTS.read_text().splitlines()[:n]]
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        for line in extra:
            f.write(line + "\n")
    return records


def write_spec(folder: Path, *, n: int = 12, extra: list[str] = (), **changes) -> Path:
    data = folder / "prompts.jsonl"
    write_prompts(data, n, extra)
    spec = {"version": 1, "name": "gen", "device": "cpu",
            "model": {"hf": {"path": str(FOLDER), "class": "AutoModelForCausalLM"},
                      "dtype": "float32"},
            "data": {"path": str(data), "id_field": "id",
                     "text": {"field": "prompt", "truncate": True},
                     "batch_size": 4, "group_by_length": 8},
            "generate": {"max_new_tokens": NEW, "sampling": {"method": "greedy"}},
            "buckets": {"batch": [1, 4], "seq": [64, 128, 512]},
            "output": {"dir": str(folder / "out"), "format": "jsonl"}}
    for key, value in changes.items():
        section, _, leaf = key.partition("__")
        if leaf:
            spec[section][leaf] = value
        else:
            spec[section] = value
    path = folder / "gen.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def completions(out: Path) -> list[dict]:
    rows = []
    for part in sorted(out.glob("part-*.jsonl")):
        rows += [json.loads(line) for line in part.read_text().splitlines()]
    return rows


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(FOLDER)
    model = transformers.AutoModelForCausalLM.from_pretrained(FOLDER).eval()
    return tok, model


def hf_greedy(hf, text: str, max_prompt: int = 512) -> list[int]:
    tok, model = hf
    ids = tok(text, return_tensors="pt").input_ids[:, -max_prompt:]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                             do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_completions_equal_transformers_generate_in_input_order(tmp_path, hf):
    spec = write_spec(tmp_path)
    manifest = graphrun.run(graphrun.load_spec(spec))
    rows = completions(tmp_path / "out")
    prompts = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [p["id"] for p in prompts]  # grouped, written in order
    tok = hf[0]
    for row, prompt in zip(rows, prompts):
        want = hf_greedy(hf, prompt["prompt"])
        assert row["token_ids"] == want, row["id"]
        assert row["text"] == tok.decode(want, skip_special_tokens=True)
        assert row["prompt_tokens"] == len(tok(prompt["prompt"]).input_ids)
        assert row["output_tokens"] == len(want)
        eos = tok.eos_token_id
        assert row["finish_reason"] == ("eos" if want[-1] == eos else "length")
    gen = manifest.generation
    assert gen.records == len(rows) == manifest.totals.records_out
    assert gen.output_tokens == sum(r["output_tokens"] for r in rows)
    assert sum(gen.finish_reasons.values()) == len(rows)
    assert gen.kv_cache_bytes > 0 and gen.graphs
    assert manifest.spec["inputs"] == {} and manifest.spec["outputs"] == {}


def test_bad_prompts_are_rejected_with_their_lines_and_long_ones_cut_from_the_left(tmp_path,
                                                                                  hf):
    long_text = " ".join(["the long tale goes on"] * 60)
    extra = ['{"id": "no-prompt", "text": "x"}', '{"id": "not-text", "prompt": 7}',
             json.dumps({"id": "long", "prompt": long_text})]
    spec = write_spec(tmp_path, n=4, extra=extra, data__on_bad_record="skip",
                      buckets={"batch": [1, 4], "seq": [32, 64]})
    manifest = graphrun.run(graphrun.load_spec(spec))
    rows = {r["id"]: r for r in completions(tmp_path / "out")}
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text()
               .splitlines()]
    assert sorted(r["id"] for r in rejects) == ["no-prompt", "not-text"]
    assert {r["where"].rsplit(":", 1)[1] for r in rejects} == {"5", "6"}  # their lines
    assert manifest.totals.records_in == manifest.totals.records_out + 2
    # truncate keeps the prompt's end: the last 64 tokens, as HF is given them
    assert rows["long"]["prompt_tokens"] == 64
    assert rows["long"]["token_ids"] == hf_greedy(hf, long_text, max_prompt=64)


@pytest.mark.parametrize("text", [{"field": "prompt", "truncate": False}, {"field": "prompt"}],
                         ids=["off", "unset"])
def test_a_too_long_prompt_is_rejected_unless_truncate_is_set(tmp_path, text):
    long_text = " ".join(["words"] * 400)
    spec = write_spec(tmp_path, n=3, extra=[json.dumps({"id": "long", "prompt": long_text})],
                      data__on_bad_record="skip", data__text=text)
    assert graphrun.load_spec(spec).data.text.truncate is False
    graphrun.run(graphrun.load_spec(spec))
    rejects = (tmp_path / "out" / "rejects.jsonl").read_text()
    assert '"long"' in rejects and "tokens, more than 512" in rejects
    assert [r["id"] for r in completions(tmp_path / "out")] == ["p0000", "p0001", "p0002"]


def test_sampled_completions_do_not_depend_on_the_batching(tmp_path):
    sampling = {"max_new_tokens": NEW, "sampling": {"method": "sample", "temperature": 1.5,
                                                    "top_k": 50, "seed": 11}}
    runs = {}
    for name, data in (("alone", {"batch_size": 1}), ("grouped", {"batch_size": 4,
                                                                  "group_by_length": 12})):
        folder = tmp_path / name
        folder.mkdir()
        spec = write_spec(folder, generate=sampling)
        loaded = graphrun.load_spec(spec, [f"data.{k}={v}" for k, v in data.items()])
        graphrun.run(loaded)
        runs[name] = [r["token_ids"] for r in completions(folder / "out")]
    assert runs["alone"] == runs["grouped"]
    greedy_like = sum(len(set(r)) == 1 for r in runs["alone"])
    assert greedy_like < len(runs["alone"])  # the draws vary: the test can tell


def test_the_builtin_llama_generates_stopping_at_its_tokenizers_eos(tmp_path):
    from graphrun.generate.runner import generate_config

    model = {"builtin": "llama", "dtype": "float32",
             "args": {"layers": 2, "d_model": 64, "heads": 4, "kv_heads": 2, "vocab": 512,
                      "max_len": 600}}
    spec = write_spec(tmp_path, n=6, model=model,
                      data__text={"field": "prompt", "tokenizer": str(FOLDER)})
    loaded = graphrun.load_spec(spec)
    manifest = graphrun.run(loaded)
    rows = completions(tmp_path / "out")
    assert [r["id"] for r in rows] == [f"p000{i}" for i in range(6)]
    assert all(1 <= r["output_tokens"] <= NEW for r in rows)
    assert manifest.generation.records == 6
    # stop.eos auto: a builtin has no config, so its tokenizer's folder names the EOS
    eos = json.loads((FOLDER / "generation_config.json").read_text())["eos_token_id"]
    assert generate_config(loaded, None).eos_ids == (eos,)


def test_a_dictionary_encoded_parquet_prompt_column_reads_as_its_strings(tmp_path):
    """pandas writes a category column as a dictionary of strings: its prompts are the same
    as a plain string column's, a null among them a bad record."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from graphrun.generate.records import with_implied_io
    from graphrun.read.stream import read_batches

    texts = ["An old fisherman", None, "An old fisherman", "The committee"]
    spec = write_spec(tmp_path, buckets={"batch": [1, 4], "seq": [64]},
                      data__on_bad_record="skip")
    read = {}
    for kind, column in (("plain", pa.array(texts)),
                         ("dictionary", pa.array(texts).dictionary_encode())):
        path = tmp_path / f"{kind}.parquet"
        pq.write_table(pa.table({"id": ["a", "b", "c", "d"], "prompt": column}), path)
        loaded = with_implied_io(graphrun.load_spec(spec, [f"data.path={path}"]))
        batches = list(read_batches(loaded))
        # group_by_length orders the batches by length: the prompts are compared by id
        read[kind] = ({i: row[:n].tolist() for b in batches
                       for i, row, n in zip(b.ids, b.fields["input_ids"], b.lengths["seq"])},
                      [(r.id, r.reason) for b in batches for r in b.rejects])
    assert read["dictionary"] == read["plain"]
    prompts, rejects = read["plain"]
    assert sorted(prompts) == ["a", "c", "d"] and prompts["a"] == prompts["c"]
    assert rejects == [("b", "prompt: expected a string, got null")]


def test_a_wrong_section_is_refused_before_any_work(tmp_path):
    spec = write_spec(tmp_path, output={"dir": str(tmp_path / "out"), "format": "npy"})
    result = CliRunner().invoke(main, ["run", str(spec)])
    assert result.exit_code != 0
    assert "output.format" in result.output and "jsonl or parquet" in result.output
    assert not (tmp_path / "out").exists()


def test_validate_load_and_plan_take_a_generation_spec(tmp_path):
    spec = write_spec(tmp_path, n=6)
    loaded = CliRunner().invoke(main, ["validate", "--load", str(spec)])
    assert loaded.exit_code == 0, loaded.output
    # decode rows [1, 4] and prefill tokens [64, 128, 512]
    assert "called on each of 5 buckets" in loaded.output
    planned = CliRunner().invoke(main, ["plan", str(spec)])
    assert planned.exit_code == 0, planned.output
    assert "seq:" in planned.output and "bucket plans over 6 records" in planned.output


def test_validate_load_sizes_the_kv_blocks_as_the_run_does(tmp_path):
    # validate --load tries each bucket with a few new tokens, yet a record's blocks are
    # counted with the spec's max_new_tokens, so both refuse the same kv_blocks alike
    outcomes = {}
    for blocks in (63, 64, 65):  # the prompt axis ends at 1,024 - 40 tokens: 64 blocks
        spec = write_spec(tmp_path, n=6, buckets={"batch": [1, 4], "seq": "auto"},
                          generate={"max_new_tokens": 40, "kv_blocks": blocks,
                                    "sampling": {"method": "greedy"}})
        checked = CliRunner().invoke(main, ["validate", "--load", str(spec)])
        ran = CliRunner().invoke(main, ["run", str(spec), "-q", "--overwrite"])
        told = [line for line in checked.output.splitlines() if "KV blocks" in line]
        said = [line for line in ran.output.splitlines() if "KV blocks" in line]
        outcomes[blocks] = checked.exit_code, ran.exit_code
        assert (checked.exit_code == 0) == (ran.exit_code == 0), (blocks, checked.output,
                                                                  ran.output)
        assert [t.removeprefix("error: ") for t in said] == told
    assert outcomes == {63: (1, 2), 64: (1, 2), 65: (0, 0)}


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [{"method": "greedy"},
                                      {"method": "sample", "temperature": 1.3, "seed": 5}])
def test_kill_9_then_resume_gives_the_same_completions(tmp_path, sampling):
    clean = tmp_path / "clean"
    clean.mkdir()
    spec = write_spec(clean, n=24, data__group_by_length=None,
                      generate={"max_new_tokens": NEW, "sampling": sampling},
                      output={"dir": str(clean / "out"), "format": "jsonl",
                              "rows_per_file": 4})
    graphrun.run(graphrun.load_spec(spec))
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "graphrun", "run", str(spec), "--out",
                             str(out), "-q"], env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "journal.jsonl").exists() or \
            (out / "journal.jsonl").read_bytes().count(b"\n") < 2:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "no shard was committed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    result = CliRunner().invoke(main, ["run", str(spec), "--out", str(out), "--resume", "-q"])
    assert result.exit_code == 0, result.output
    assert completions(out) == completions(clean / "out")


@pytest.mark.slow
def test_gpus_workers_give_the_same_completions_as_one_process(tmp_path):
    # prompts cut to 64 tokens: the workers' counts of cut prompts add up to one process's
    spec = write_spec(tmp_path, n=16, data__text={"field": "prompt", "max_length": 64,
                                                  "truncate": True})
    one = graphrun.run(graphrun.load_spec(spec), out=tmp_path / "one")
    # the --gpus parent in this process (its workers are processes): the job's merge is what
    # is checked, not the parent's process
    job = CliRunner().invoke(main, ["run", str(spec), "--gpus", "2", "--out",
                                    str(tmp_path / "two"), "-q"])
    assert job.exit_code == 0 and job.exception is None, job.output
    assert completions(tmp_path / "two") == completions(tmp_path / "one")
    merged = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert merged["totals"]["records_out"] == one.totals.records_out == 16
    assert merged["totals"]["texts_truncated"] == one.totals.texts_truncated > 0
    assert merged["totals"]["text_max_tokens"] == one.totals.text_max_tokens == 64
    gen = merged["generation"]  # the workers' sections added up
    assert gen["records"] == 16 and gen["output_tokens"] == one.generation.output_tokens
    assert gen["finish_reasons"] == one.generation.finish_reasons
    assert gen["prompts_truncated"] == one.generation.prompts_truncated
    assert gen["decode_attention"] == one.generation.decode_attention == "general"
    # each worker's graphs, by its rank; the summary shows a size once, not once per worker
    assert sorted((x["rank"], x["kind"], x["size"]) for x in gen["graphs"]) == sorted(
        (r, x.kind, x.size) for r in (0, 1) for x in one.generation.graphs)
    from graphrun.job.progress import generation_table, graph_setup
    from graphrun.manifest.sections import Generation

    shown = Generation.model_validate(gen)
    assert generation_table(shown, "t").row_count == len(one.generation.graphs)
    assert "2 workers, each its own" in graph_setup(shown)


@pytest.mark.slow
def test_torchrun_workers_give_the_same_completions_as_one_process(tmp_path):
    import socket

    spec = write_spec(tmp_path, n=10)
    graphrun.run(graphrun.load_spec(spec), out=tmp_path / "one")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "graphrun", "run", str(spec), "--out", str(tmp_path / "two"),
         "-q"], env=dict(child_env(), RANK=str(k), LOCAL_RANK=str(k), WORLD_SIZE="2",
                         LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    assert completions(tmp_path / "two") == completions(tmp_path / "one")
    merged = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert merged["generation"]["records"] == 10 and len(merged["workers"]) == 2


def test_the_prefills_padding_is_reported_as_run(tmp_path):
    """One slot: each prefill packs one prompt, padded to the smallest seq bucket that holds
    it; the manifest's prefill_positions are those sizes' sum and prefill_padding the share
    of them that held no prompt token, and the summary says it."""
    spec = graphrun.load_spec(write_spec(tmp_path, generate__slots=1,
                                         generate__prefix_cache=False, buckets={
                                             "batch": [1], "seq": [64, 128, 512]}))
    m = graphrun.run(spec, show=False)
    lengths = [r["prompt_tokens"] for r in completions(spec.output.dir)]
    g = m.generation
    assert g.prefills == len(lengths) == 12 and g.prompt_tokens_computed == sum(lengths)
    assert g.prefill_positions == sum(min(s for s in (64, 128, 512) if s >= n) for n in lengths)
    assert g.prefill_padding == pytest.approx(1 - sum(lengths) / g.prefill_positions)
    from graphrun.job.progress import generation_line

    assert (f"prefill padding {g.prefill_padding:.0%} of {g.prefill_positions:,} positions"
            in generation_line(g))


def test_the_summary_shows_the_engines_graphs_not_the_parts(tmp_path):
    """A generation job's summary table has a row per graph the engine set up (decode by
    rows, prefill by tokens) and says how many and why they are not captured; no forward
    job's rows padding, which a generation job does not compute."""
    result = CliRunner().invoke(main, ["run", str(write_spec(tmp_path)), "--out",
                                       str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    rows = [ln.split() for ln in lines if ln.startswith(("decode ", "prefill "))]
    assert [r[:4] for r in rows] == [
        ["decode", "1", "row", "eager"], ["decode", "4", "rows", "eager"],
        ["prefill", "64", "tokens", "eager"], ["prefill", "128", "tokens", "eager"],
        ["prefill", "512", "tokens", "eager"]]
    assert ("graphs: 5 (2 decode, 3 prefill): 5 set up at start, 5 eager (no CUDA device: "
            "backend eager)") in result.output
    assert "of rows" not in result.output and "bucket " not in result.output
    assert "prefill padding" in result.output  # the padding it computed: the prefills'
