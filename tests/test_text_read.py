"""data.text tokenized ahead of the stream (read/ahead.py on the JSONL reader's threads): the
same batches, ids, rejects, errors and truncation counts as tokenized in line or by child
processes; the ordered map itself keeps order, raises in turn and stops when closed."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import graphrun
from graphrun.base.errors import InputError
from graphrun.base.tuning import Tuning
from graphrun.read.ahead import ahead_map
from graphrun.read.checks import precheck
from graphrun.read.formats.jsonl import _blocks
from graphrun.read.formats.jsonl_parse import parse_block
from graphrun.read.stream import read_batches
from graphrun.read.text import TextCuts

needs_hf = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or
    importlib.util.find_spec("tokenizers") is None,
    reason="needs transformers and tokenizers (the hf extra)")

SMALL = dict(jsonl_chunk_bytes=512)  # many blocks from a small file
IN_LINE = Tuning(jsonl_workers=0, text_threads=0, **SMALL)
THREADS = Tuning(jsonl_workers=0, text_threads=2, text_ahead=3, **SMALL)
CHILDREN = Tuning(jsonl_workers=2, jsonl_workers_min_bytes=0, **SMALL)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers")
    from tests.test_hf_text_tasks import save_classifier
    return save_classifier(tmp_path_factory.mktemp("rerank"), 1)


def lines(n: int = 60) -> list[str]:
    """Texts of mixed lengths (every 7th past the 32-token limit) and bad records among them."""
    from tests.test_init_hf import WORDS

    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        k = 45 if i % 7 == 0 else int(rng.integers(1, 20))
        out.append(json.dumps({"id": f"r{i}", "q": "a cat",
                               "text": " ".join(rng.choice(WORDS, k))}))
    out[5] = '{"id": "r5", "text": 12}'  # not a string
    out[11] = '{"id": "r11", "txt": "the dog"}'  # no text field
    out[17] = '{"id": "r17", "text": "the'  # invalid JSON
    out[23] = json.dumps({"id": "r3", "text": "a duplicate id"})
    return out


def spec_of(tmp_path, folder, **data):
    from tests.test_hf_text_tasks import spec_for

    path = spec_for(tmp_path, folder, 1, data.pop("field", "text"), [], on_bad_record="skip",
                    **data)
    (tmp_path / "data.jsonl").write_text("\n".join(lines()) + "\n")
    return graphrun.load_spec(path)


def read_all(spec, tuning: Tuning) -> tuple[list, list, int]:
    """(each batch as ids and token lists, every reject, texts cut)."""
    cuts = TextCuts(spec)
    batches, rejects = [], []
    for b in read_batches(spec, tuning=tuning, cuts=cuts):
        batches.append((list(b.ids), {n: [r.tolist() for r in b.fields[n]] for n in b.fields}))
        rejects += [(r.index, r.id, r.where, r.reason) for r in b.rejects]
    return batches, rejects, cuts.count


@needs_hf
@pytest.mark.parametrize("group", [None, 16], ids=["input-order", "grouped"])
@pytest.mark.parametrize("field", ["text", ["q", "text"]], ids=["text", "pair"])
def test_threads_children_and_in_line_read_the_same(tmp_path, folder, group, field):
    spec = spec_of(tmp_path, folder, group_by_length=group, field=field)
    want = read_all(spec, IN_LINE)
    batches, rejects, cut = want
    assert len(rejects) == 4 and rejects[0][2] == "data.jsonl:6"
    assert cut == 9 and sum(len(ids) for ids, _ in batches) == 56
    assert read_all(spec, THREADS) == want
    assert read_all(spec, CHILDREN) == want


@needs_hf
def test_the_first_bad_record_stops_the_read_after_the_same_batches(tmp_path, folder):
    spec = spec_of(tmp_path, folder)
    spec = spec.model_copy(update={"data": spec.data.model_copy(
        update={"on_bad_record": "error"})})
    seen = {}
    for name, tuning in (("in line", IN_LINE), ("threads", THREADS)):
        ids = []
        with pytest.raises(InputError) as err:
            for b in read_batches(spec, tuning=tuning):
                ids += list(b.ids)
        seen[name] = (ids, str(err.value))
    assert seen["threads"] == seen["in line"]
    assert seen["in line"][0] == [f"r{i}" for i in range(5)]
    assert "data.jsonl:6" in seen["in line"][1]


@needs_hf
def test_a_prechecked_chunk_pickles_its_ragged_records_as_one_array(tmp_path, folder):
    spec = spec_of(tmp_path, folder)
    with open(spec.data.path, "rb") as f:
        block = next(_blocks(f, "data.jsonl", 0, None, 1 << 20))
    chunk = precheck(spec, parse_block(spec, block))
    back = pickle.loads(pickle.dumps(chunk))
    for name, records in chunk.converted.items():
        assert len(back.converted[name]) == len(records)
        for a, b in zip(records, back.converted[name]):
            assert a.dtype == b.dtype and np.array_equal(a, b)
    assert (back.problems, back.cut, list(back.where)) == (chunk.problems, chunk.cut,
                                                           list(chunk.where))


def test_results_come_in_order_whatever_finishes_first():
    def slow(i):
        time.sleep(0.02 * ((7 * i) % 5))
        return i * i

    assert list(ahead_map(slow, range(20), threads=3, depth=5)) == [i * i for i in range(20)]


def test_an_error_is_raised_in_its_turn_after_the_results_before_it():
    def fn(i):
        if i == 4:
            raise ValueError("item 4")
        return i

    got = []
    with pytest.raises(ValueError, match="item 4"):
        for v in ahead_map(fn, range(10), threads=2, depth=4):
            got.append(v)
    assert got == [0, 1, 2, 3]


def test_an_error_reading_the_items_comes_after_the_items_read_before_it():
    def items():
        yield from range(3)
        raise OSError("the disk went away")

    got = []
    with pytest.raises(OSError, match="disk"):
        for v in ahead_map(lambda i: -i, items(), threads=2, depth=8):
            got.append(v)
    assert got == [0, -1, -2]


def test_closing_early_stops_the_work_ahead():
    done, started = [], threading.Event()

    def fn(i):
        started.set()
        time.sleep(0.01)
        done.append(i)
        return i

    it = ahead_map(fn, range(1000), threads=2, depth=4)
    assert next(it) == 0
    it.close()
    count = len(done)
    time.sleep(0.05)
    assert count == len(done) <= 5  # what was running ended; nothing more started
    assert not [t for t in threading.enumerate() if t.name.startswith("graphrun-ahead")]


@needs_hf
def test_a_child_tokenizing_text_does_not_import_torch(tmp_path, folder):
    """Each JSONL child process starts as the run reads; torch's import would cost it seconds."""
    spec = spec_of(tmp_path, folder)
    (tmp_path / "spec.pickle").write_bytes(pickle.dumps(spec))
    code = ("import pickle, sys\n"
            "from graphrun.read.formats.jsonl import _blocks\n"
            "from graphrun.read.formats.jsonl_workers import _parse_and_precheck\n"
            f"spec = pickle.loads(open({str(tmp_path / 'spec.pickle')!r}, 'rb').read())\n"
            "with open(spec.data.path, 'rb') as f:\n"
            "    chunk = _parse_and_precheck(spec, next(_blocks(f, 'd', 0, None, 1 << 20)))\n"
            "assert len(chunk.indices) > 40, len(chunk.indices)\n"
            "print('torch' in sys.modules)\n")
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
