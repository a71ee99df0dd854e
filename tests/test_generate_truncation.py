"""Texts cut by data.text.truncate, counted: read in this process (in line or on the threads
tokenizing ahead), by JSONL child processes and from Parquet (the count comes back with each
block), for a generation job's prompts (cut from the left) and an encoder's texts (from the
right), into the manifest (totals.texts_truncated, generation.prompts_truncated), the run's
summary line, and a --gpus job's merged totals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

pytest.importorskip("tokenizers")

import graphrun  # noqa: E402
from graphrun.base.tuning import Tuning  # noqa: E402
from graphrun.cli.main import main  # noqa: E402
from graphrun.generate.records import with_implied_io  # noqa: E402
from graphrun.job.progress import text_cuts  # noqa: E402
from graphrun.read.stream import read_batches  # noqa: E402
from graphrun.read.text import TextCuts  # noqa: E402
from tests.test_generate_job import FOLDER, completions, write_spec  # noqa: E402

CHILDREN = Tuning(jsonl_workers=2, jsonl_workers_min_bytes=0, jsonl_chunk_bytes=2048)
HERE = Tuning(jsonl_workers=0, text_threads=0, jsonl_chunk_bytes=2048)
THREADS = Tuning(jsonl_workers=0, text_threads=2, jsonl_chunk_bytes=2048)
LONG = " ".join(["the long tale goes on"] * 60)  # well over 64 tokens


def prompts_file(path: Path, n: int = 40, every: int = 3) -> int:
    """n records, every `every`-th one long; returns how many are long."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"r{i}", "prompt": LONG if i % every == 0 else
                                f"a short prompt {i}"}) + "\n")
    return len(range(0, n, every))


def counted(spec, tuning: Tuning, **kw) -> tuple[int, int]:
    """(texts cut, records read) over the whole file."""
    cuts = TextCuts(spec, kw.pop("count_from", 0))
    batches = list(read_batches(spec, tuning=tuning, cuts=cuts, **kw))
    return cuts.count, sum(len(b) for b in batches)


def generation_spec(tmp_path: Path, **changes):
    path = write_spec(tmp_path, buckets={"batch": [1, 4], "seq": [32, 64]}, **changes)
    return with_implied_io(graphrun.load_spec(path))


@pytest.mark.parametrize("tuning", [HERE, THREADS, CHILDREN], ids=["here", "threads",
                                                                   "children"])
def test_cut_prompts_are_counted_in_this_process_and_by_the_children(tmp_path, tuning):
    spec = generation_spec(tmp_path)
    long = prompts_file(spec.data.path)
    assert counted(spec, tuning) == (long, 40)
    # a resumed run does not count again what the run it resumes read (ordinals below 30)
    assert counted(spec, tuning, start=27, count_from=30) == (
        len(range(30, 40, 3)), 13)


def test_parquet_prompts_are_counted_as_jsonl_ones(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    spec = generation_spec(tmp_path)
    long = prompts_file(spec.data.path)
    rows = [json.loads(line) for line in Path(spec.data.path).read_text().splitlines()]
    pq.write_table(pa.table({"id": [r["id"] for r in rows],
                             "prompt": [r["prompt"] for r in rows]}),
                   tmp_path / "prompts.parquet", row_group_size=8)
    parquet = spec.model_copy(update={"data": spec.data.model_copy(
        update={"path": tmp_path / "prompts.parquet"})})
    assert counted(parquet, HERE) == (long, 40)


def test_a_rejected_record_is_not_counted_as_cut(tmp_path):
    spec = generation_spec(tmp_path, data__on_bad_record="skip")
    prompts_file(spec.data.path, n=6)
    with open(spec.data.path, "a") as f:  # a long prompt with an id seen already: rejected
        f.write(json.dumps({"id": "r0", "prompt": LONG}) + "\n")
    assert counted(spec, HERE) == (2, 6)


def test_an_encoders_texts_are_cut_from_the_right_and_counted(tmp_path):
    data = tmp_path / "texts.jsonl"
    long = prompts_file(data, n=10)
    spec = {"version": 1, "name": "enc", "device": "cpu",
            "model": {"hf": {"path": str(FOLDER), "class": "AutoModelForCausalLM"}},
            "inputs": {"input_ids": {"shape": ["batch", "seq"], "dtype": "int64"},
                       "attention_mask": {"shape": ["batch", "seq"], "dtype": "int64",
                                          "pad": 0}},
            "outputs": {"next_ids": {"shape": ["batch", 5], "from": "logits",
                                     "reduce": ["last_pool"], "topk": {"k": 5,
                                                                       "take": "ids"}}},
            "buckets": {"batch": [1, 4], "seq": [16, 32]},
            "data": {"path": str(data), "id_field": "id", "batch_size": 4,
                     "text": {"field": "prompt", "truncate": True}},
            "output": {"dir": str(tmp_path / "out"), "format": "jsonl"}}
    (tmp_path / "enc.yaml").write_text(yaml.safe_dump(spec))
    loaded = graphrun.load_spec(tmp_path / "enc.yaml")
    cuts = TextCuts(loaded)
    batches = list(read_batches(loaded, tuning=HERE, cuts=cuts))
    assert (cuts.count, cuts.length, cuts.side) == (long, 32, "right")
    first = batches[0].fields["input_ids"][0]  # r0, long: its start kept
    assert len(first) == 32


def test_a_generation_job_records_and_prints_its_cut_prompts(tmp_path):
    path = write_spec(tmp_path, buckets={"batch": [1, 4], "seq": [32, 64]})
    long = prompts_file(tmp_path / "prompts.jsonl", n=7)
    spec = yaml.safe_load(path.read_text())
    spec["generate"]["max_new_tokens"] = 3
    path.write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(main, ["run", str(path)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["totals"]["texts_truncated"] == long == 3
    assert manifest["totals"]["text_max_tokens"] == 64
    assert manifest["generation"]["prompts_truncated"] == 3
    assert "texts: 3 prompts cut to 64 tokens (data.text.truncate, from the left)" \
        in " ".join(result.output.split())
    rows = completions(tmp_path / "out")
    assert [r["prompt_tokens"] for r in rows if r["id"] in ("r0", "r3", "r6")] == [64] * 3


def test_the_summary_line_is_left_out_where_nothing_can_be_cut():
    class M:
        def __init__(self, truncated, text):
            self.totals = type("T", (), {"texts_truncated": truncated,
                                         "text_max_tokens": 32})()
            self.spec = {"data": {"text": text}, "generate": None}

    assert text_cuts(M(None, None)) is None  # not a data.text job
    assert text_cuts(M(0, {"field": "t", "truncate": False})) is None  # rejected instead
    assert text_cuts(M(1, {"field": "t", "truncate": True})) == (
        "texts: 1 text cut to 32 tokens (data.text.truncate, from the right)")


def test_merged_totals_add_the_workers_cuts():
    from graphrun.scale.local.merge import _sum_known

    assert _sum_known([2, None, 5]) == 7
    assert _sum_known([None, None]) is None


def test_a_piped_generation_run_prints_output_tokens_per_second(tmp_path, monkeypatch):
    from graphrun.job import progress

    # a patch: the CLI builds its own progress, reached only through the command
    monkeypatch.setattr(progress, "LINE_S", 0.0)  # a line every batch
    path = write_spec(tmp_path, n=8, data__group_by_length=None,
                      generate={"max_new_tokens": 4, "min_new_tokens": 4,
                                "sampling": {"method": "greedy"}})
    result = CliRunner().invoke(main, ["run", str(path)])  # CliRunner's stdout: no terminal
    assert result.exit_code == 0, result.output
    lines = [l.split(" ", 1)[1] for l in result.output.splitlines()
             if " graphrun: " in l and "records (" in l]
    # a line as each batch of 4 finishes, its 16 tokens counted
    assert len(lines) == 2, result.output
    rates = [float(re.search(r", ([\d,.]+) output tokens/s", l).group(1).replace(",", ""))
             for l in lines]
    assert rates[0] > 0 and rates[1] > 0, lines
    assert lines[0].startswith("graphrun: 4/8 records (50%), ")
    assert lines[1].startswith("graphrun: 8/8 records (100%), ")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["generation"]["output_tokens"] == 32
    assert re.search(r"generation: 32 output tokens \(length 8\), [\d,]+ tokens/s; TTFT p50 "
                     r"[\d.]+ ms; TPOT p50 [\d.]+ ms; \d+% of decode row-steps wasted, "
                     r"4 slots \d+% occupied, KV blocks peak \d+ of \d+",
                     " ".join(result.output.split())), result.output  # rich wraps at 80


def test_progress_lines_give_the_output_tokens_rate():
    import io

    from graphrun.job.progress import ProgressLines

    lines = ProgressLines(total=8, out=io.StringIO(), tokens=lambda: 120)
    lines.done = 4
    assert lines.line(2.0).split(" ", 1)[1] == (
        "graphrun: 4/8 records (50%), 2 records/s, 60 output tokens/s, ETA 0:00:02")


def test_a_prompt_holding_a_lone_surrogate_is_rejected_with_its_line(tmp_path):
    spec = generation_spec(tmp_path, data__on_bad_record="skip")
    prompts_file(spec.data.path, n=4)
    with open(spec.data.path, "a") as f:  # valid JSON; UTF-8 cannot encode it
        f.write('{"id": "bad", "prompt": "a \\ud800 b"}\n')
        f.write('{"id": "after", "prompt": "fine"}\n')
    for start in (0, 2):  # a first run and a resumed one
        rejects = [r for b in read_batches(spec, tuning=HERE, start=start) for r in b.rejects]
        assert [(r.id, r.where) for r in rejects] == [("bad", "prompts.jsonl:5")]
        assert "not valid Unicode" in rejects[0].reason


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_long_text_cut_on_characters_keeps_the_tokens_truncation_keeps(side):
    from graphrun.read.text import _tokenizer, bounded_text

    tok = _tokenizer(str(FOLDER), 64, True, side)
    text = " ".join(f"word{i % 97} tale" for i in range(20000))  # ~220k characters
    cut, was_cut = bounded_text(tok, text, 64, side)
    assert was_cut and len(cut) < len(text) // 10
    assert tok.encode(cut).ids == tok.encode(text).ids
    # a text whose tokens run longer than the first guess is widened until it is sure
    dense = "x" * 200000 + " end"
    cut, _ = bounded_text(tok, dense, 64, side)
    assert tok.encode(cut).ids == tok.encode(dense).ids


def test_a_prompt_of_megabytes_does_not_take_memory_in_proportion(tmp_path):
    """The reader's peak memory over a 4 MB prompt, in a child process: tokenizing it whole
    would take hundreds of MB."""
    import subprocess
    import sys

    spec = generation_spec(tmp_path)
    peaks = []
    for size in (10, 4_000_000):
        Path(spec.data.path).write_text(json.dumps(
            {"id": "r0", "prompt": ("the long tale goes on " * (size // 22 + 1))[:size]}) + "\n")
        code = ("import resource, sys, graphrun\n"
                "from graphrun.base.tuning import Tuning\n"
                "from graphrun.generate.records import with_implied_io\n"
                "from graphrun.read.stream import read_batches\n"
                f"spec = with_implied_io(graphrun.load_spec({str(tmp_path / 'gen.yaml')!r}))\n"
                "b = list(read_batches(spec, tuning=Tuning(jsonl_workers=0, text_threads=0)))\n"
                "print(len(b[0].fields['input_ids'][0]),\n"
                "      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=300, cwd=Path(__file__).parent.parent)
        assert done.returncode == 0, done.stderr
        tokens, peak = done.stdout.split()[-2:]
        peaks.append(int(peak) / 1024)  # MiB
    assert int(tokens) == 64  # the long prompt cut to the largest seq bucket
    assert peaks[1] - peaks[0] < 100, peaks


def test_a_token_id_past_the_models_vocabulary_rejects_its_record(tmp_path):
    """A tokenizer of another model (more ids than the model's table): the records whose
    tokens index past it are rejected, naming the id, the others read."""
    import shutil

    from tokenizers import Tokenizer

    model = tmp_path / "model"
    shutil.copytree(FOLDER, model)
    config = json.loads((model / "config.json").read_text())
    tok = Tokenizer.from_file(str(FOLDER / "tokenizer.json"))
    config["vocab_size"] = max(tok.encode("the cat").ids) + 1  # "the cat" fits, "a short ..." not
    (model / "config.json").write_text(json.dumps(config))
    spec = generation_spec(tmp_path, data__on_bad_record="skip",
                           model={"hf": {"path": str(model), "class": "AutoModelForCausalLM"},
                                  "dtype": "float32"})
    Path(spec.data.path).write_text("".join(
        json.dumps({"id": f"r{i}", "prompt": p}) + "\n"
        for i, p in enumerate(["the cat", "a short prompt 1", "the cat"])))
    past = max(tok.encode("a short prompt 1").ids)
    assert past >= config["vocab_size"]
    batches = list(read_batches(spec, tuning=HERE))
    assert [i for b in batches for i in b.ids] == ["r0", "r2"]
    [reject] = [r for b in batches for r in b.rejects]
    assert reject.id == "r1" and f"token id {past} is past the model's vocabulary" in reject.reason
