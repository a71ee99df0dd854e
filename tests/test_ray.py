"""graphrun on Ray Data (issue 19, many hosts) on a local Ray cluster of 2 CPUs, eager backend:
`graphrun run --ray` writes what the single-process run writes, record for record, ids in input
order, from Parquet and JSONL; rejects keep their reasons; graphrun.ray.dataset_map works from
Python; without Ray installed, --ray names the extra to install."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import jsonschema
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main

# end to end: processes, real models, whole runs (`pytest -m "not slow"` leaves them out)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
MANIFEST_SCHEMA = json.loads((ROOT / "schemas" / "manifest.schema.json").read_text())
N = 43  # records: several batches of 4, a last one short, one of them rejected
BAD = 5  # its k is out of range

MODEL = """\
import torch


class Model(torch.nn.Module):
    def forward(self, x, k, t):
        # x: [B, 4] float32; k: [B] int64; t: [B, S] int64
        y = x * 2 + k[:, None].to(x.dtype)
        y[:, 0] = torch.where(k == 7, float("nan"), y[:, 0])  # non-finite values written
        y[:, 1] = torch.where(k == 8, float("-inf"), y[:, 1])
        return {"y": y, "s": t.to(torch.float32) + 0.5}


def build():
    return Model()
"""


# Each actor builds its model once the other has started too, so that both are ready before
# the blocks are handed out (the first one ready would otherwise take them all).
BOTH_ACTORS = """

def _both_actors(build=build):
    import os
    import time
    from pathlib import Path

    here = Path(__file__).parent
    (here / f"actor-{os.getpid()}").touch()
    deadline = time.monotonic() + 60
    while len(list(here.glob("actor-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return build()


build = _both_actors
"""


@pytest.fixture(scope="module")
def ray_cluster():
    """One local cluster for the whole file: starting one takes seconds. Ray's Parquet reader
    lists a file's row groups on a pool of FooterReader actors, 32 by default (a big
    cluster's many network-bound footer reads): on this 2-CPU cluster, 32 worker processes
    started for each read_parquet of one small file, seconds of the 2 CPUs each time. One
    actor lists them the same way (the variable reaches the cluster's workers through the
    environment they inherit)."""
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", "1")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield ray
        ray.shutdown()


def records() -> list[dict]:
    """x, k and a ragged t (seq 1..7, padded to the buckets 4 and 8); string ids."""
    rng = np.random.default_rng(0)
    rows = [{"id": f"r{i}", "x": rng.random(4).round(3).tolist(), "k": i % 10,
             "t": list(range(i % 7 + 1))} for i in range(N)]
    rows[BAD]["k"] = 11
    return rows


def write_case(tmp_path: Path, fmt: str, *, on_bad_record: str = "skip") -> Path:
    """The spec, its model and its input (data.<fmt>); outputs in the same format."""
    rows = records()
    if fmt == "parquet":
        pq.write_table(pa.table({k: [r[k] for r in rows] for k in rows[0]}),
                       tmp_path / "data.parquet", row_group_size=10)
    else:
        (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "model.py").write_text(MODEL)
    spec = {
        "version": 1, "name": "ray-test", "device": "cpu", "model": {"target": "model.py:build"},
        "inputs": {"x": {"shape": ["batch", 4], "dtype": "float32"},
                   "k": {"shape": ["batch"], "dtype": "int64", "range": [0, 10]},
                   "t": {"shape": ["batch", "seq"], "dtype": "int64", "range": [0, 100]}},
        "outputs": {"y": {"shape": ["batch", 4]}, "s": {"shape": ["batch", "seq"]}},
        "buckets": {"batch": [1, 2, 4], "seq": [4, 8]}, "capture": {"warmup_iters": 1},
        "data": {"path": f"data.{fmt}", "id_field": "id", "batch_size": 4,
                 "on_bad_record": on_bad_record},
        "output": {"dir": "out", "format": fmt, "rows_per_file": 20},
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def read_back(out: Path, fmt: str) -> tuple[list, dict[str, list]]:
    """ids and outputs of every part-* file in name order."""
    ids, outs = [], {"y": [], "s": []}
    for f in sorted(out.glob(f"part-*.{fmt}")):
        rows = (pq.read_table(f).to_pylist() if fmt == "parquet"
                else [json.loads(line) for line in f.read_text().splitlines()])
        for r in rows:
            ids.append(r["id"])
            for name in outs:
                outs[name].append(np.asarray(r[name], np.float32))
    return ids, outs


def assert_same_outputs(got, want) -> None:
    assert got[0] == want[0]  # ids, in input order
    for name in want[1]:
        assert len(got[1][name]) == len(want[1][name])
        for a, b in zip(got[1][name], want[1][name]):
            np.testing.assert_array_equal(a, b)


def run_ray_cli(spec: Path, *args: str):
    return CliRunner().invoke(main, ["run", str(spec), "--ray", "-q", *args])


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_ray_run_equals_single_process(ray_cluster, tmp_path, fmt):
    spec_path = write_case(tmp_path, fmt)
    want_manifest = graphrun.run(graphrun.load_spec(spec_path), out=tmp_path / "single")
    result = run_ray_cli(spec_path, "--workers", "2")
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    assert_same_outputs(read_back(out, fmt), read_back(tmp_path / "single", fmt))
    assert len(read_back(out, fmt)[0]) == N - 1
    if fmt == "jsonl":  # line for line as one process writes them: strict JSON, same digits
        lines = [p.read_text() for p in sorted(out.glob("part-*.jsonl"))]
        want_lines = [p.read_text() for p in sorted((tmp_path / "single").glob("part-*.jsonl"))]
        assert "".join(lines) == "".join(want_lines)
        assert '"NaN"' in "".join(lines) and '"-Infinity"' in "".join(lines)

    # the reject, with the single-process run's id and reason
    got = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in
            (tmp_path / "single" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["index"], r["id"], r["reason"]) for r in got] == \
        [(r["index"], r["id"], r["reason"]) for r in want] == \
        [(BAD, f"r{BAD}", "k: value 11 is outside range [0, 10) (lo <= x < hi)")]

    m = json.loads((out / "manifest.json").read_text())
    jsonschema.validate(m, MANIFEST_SCHEMA)
    t = m["totals"]
    assert m["status"] == "completed"
    assert (t["records_in"], t["records_out"], t["records_rejected"]) == (N, N - 1, 1)
    assert sum(b["records"] for b in m["buckets"]) == N - 1
    # a Ray batch is data.batch_size records read, rejects included: at most one more batch
    # than the file path, which batches the valid records
    assert t["batches"] == sum(b["batches"] for b in m["buckets"])
    assert want_manifest.totals.batches <= t["batches"] <= want_manifest.totals.batches + 1
    assert m["ray"]["workers"] == 2
    assert sum(a["records"] for a in m["ray"]["actors"]) == N - 1
    assert sum(a["rejected"] for a in m["ray"]["actors"]) == 1
    assert sum(f["rows"] for f in m["files"]) == N - 1
    assert "Operator" in m["ray"]["dataset_stats"]
    # the single-process manifest has no ray key
    assert "ray" not in json.loads((tmp_path / "single" / "manifest.json").read_text())


def test_dirty_jsonl_rejected_as_one_process(ray_cluster, tmp_path):
    """A malformed line, a missing field, strings among numbers, a wrong shape, blank lines and
    a line cut short: skipped with one process's rejects.jsonl lines (file:line), the same
    outputs, exit 0 and no traceback."""
    spec_path = write_case(tmp_path, "jsonl")
    lines = [json.dumps(r) for r in records()]
    lines[2] = lines[2][:-5]  # malformed JSON
    lines[9] = json.dumps({k: v for k, v in records()[9].items() if k != "k"})
    lines[17] = lines[17].replace('"x": [', '"x": ["a", ')  # a string among numbers
    lines[23] = json.dumps({**records()[23], "t": [[1, 2]]})  # nested one level too deep
    lines[30] = lines[30] + "\n"  # a blank line after it
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n" + lines[0][:12])
    graphrun.run(graphrun.load_spec(spec_path), out=tmp_path / "single")
    result = run_ray_cli(spec_path, "--workers", "2")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    out = tmp_path / "out"
    assert_same_outputs(read_back(out, "jsonl"), read_back(tmp_path / "single", "jsonl"))
    want = (tmp_path / "single" / "rejects.jsonl").read_text()
    assert (out / "rejects.jsonl").read_text() == want
    assert [json.loads(line)["where"] for line in want.splitlines()] == [
        f"data.jsonl:{n}" for n in (3, 6, 10, 18, 24, 45)]  # BAD's range, the last line cut
    t = json.loads((out / "manifest.json").read_text())["totals"]
    assert (t["records_in"], t["records_rejected"]) == (N + 1, 6)


def test_quiet_ray_data_keeps_errors_on_the_console_and_every_line_in_its_files(tmp_path):
    """-q: Ray Data's console lines (each run's plan, its start and end, progress hints) are
    left out, its errors are not; its log files keep every line."""
    import logging

    from graphrun.scale.ray.run import quiet_console

    logger = logging.getLogger("graphrun-test-ray-data")
    console, file = logging.StreamHandler(), logging.FileHandler(tmp_path / "ray-data.log")
    console.setLevel(logging.INFO)
    for h in (console, file):
        logger.addHandler(h)
    try:
        quiet_console(logger)
        assert (console.level, file.level) == (logging.ERROR, logging.NOTSET)
    finally:
        for h in (console, file):
            logger.removeHandler(h)
            h.close()


def test_a_jsonl_datasets_columns_are_known_without_running_it(ray_cluster, tmp_path):
    """dataset_map asks for the columns: a schema fetch would run a read for the first block
    and cancel the read tasks still in flight, a race that aborted the driver inside Ray
    ("Tried to complete task that was not pending"). The source's read tasks declare it, and
    every block has that schema."""
    from graphrun.scale.ray.columns import LINE_NO, LINE_TEXT, ORDINAL
    from graphrun.scale.ray.jsonl import jsonl_lines_source

    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records()))
    source = jsonl_lines_source(path)
    ds = ray_cluster.data.read_datasource(source)
    assert ds.columns(fetch_if_missing=False) == [ORDINAL, LINE_NO, LINE_TEXT]
    for task in source.get_read_tasks(2):
        assert all(block.schema == task.schema for block in task())


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_duplicates_across_actors_rejected_as_one_process(ray_cluster, tmp_path, fmt,
                                                          monkeypatch):
    """Ids repeated far apart in a file read as several blocks, so that the copies fall in
    different actors: the same rejects.jsonl lines, ids and outputs as one process. BAD's id
    repeated later is no duplicate (its first copy was rejected); a later copy that is itself
    bad keeps its own reason."""
    from graphrun.scale.ray import jsonl

    # patches: reached only through `graphrun run --ray`; both names are looked up in this driver
    monkeypatch.setattr(jsonl, "SPAN_BYTES", 400)  # a read task per few lines
    read_parquet = ray_cluster.data.read_parquet  # one block for one file: cut it in 11
    monkeypatch.setattr(ray_cluster.data, "read_parquet",
                        lambda path: read_parquet(path).repartition(11))
    spec_path = write_case(tmp_path, fmt)
    rows = records()
    for later, earlier in {30: 1, 33: BAD, 36: 0, 41: 2, 42: 36}.items():
        rows[later]["id"] = rows[earlier]["id"]
    rows[41]["k"] = 12  # a duplicate id, but out of range first
    if fmt == "parquet":
        pq.write_table(pa.table({k: [r[k] for r in rows] for k in rows[0]}),
                       tmp_path / "data.parquet", row_group_size=4)
    else:
        (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    graphrun.run(graphrun.load_spec(spec_path), out=tmp_path / "single")
    (tmp_path / "model.py").write_text(MODEL + BOTH_ACTORS)
    result = run_ray_cli(spec_path, "--workers", "2")
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    assert_same_outputs(read_back(out, fmt), read_back(tmp_path / "single", fmt))
    want = (tmp_path / "single" / "rejects.jsonl").read_text()
    assert (out / "rejects.jsonl").read_text() == want
    reasons = {json.loads(line)["index"]: json.loads(line)["reason"] for line in want.splitlines()}
    assert sorted(reasons) == [BAD, 30, 36, 41, 42]
    assert reasons[42] == "duplicate id 'r0': an earlier record has the same id"
    assert "outside range" in reasons[41]
    t = json.loads((out / "manifest.json").read_text())["totals"]
    assert (t["records_in"], t["records_out"], t["records_rejected"]) == (N, N - 5, 5)
    m = json.loads((out / "manifest.json").read_text())
    assert [a["records"] > 0 for a in m["ray"]["actors"]] == [True, True]  # both had blocks


def test_dataset_map_from_python(ray_cluster, tmp_path):
    spec_path = write_case(tmp_path, "parquet")
    spec = graphrun.load_spec(spec_path)
    graphrun.run(spec, out=tmp_path / "single")
    # several blocks over two actors: the order holds across them
    ds = ray_cluster.data.read_parquet(str(tmp_path / "data.parquet"), override_num_blocks=4)
    mapped = graphrun.ray.dataset_map(spec, ds, workers=2)  # duplicates: none in this file
    rows = mapped.take_all()
    got = ([r["id"] for r in rows],
           {n: [np.asarray(r[n], np.float32) for r in rows] for n in ("y", "s")})
    assert_same_outputs(got, read_back(tmp_path / "single", "parquet"))
    rejects = mapped.graphrun_collector.rejects()
    assert [(r["index"], r["id"]) for r in rejects] == [(BAD, f"r{BAD}")]
    actors = mapped.graphrun_collector.stats()["actors"]
    assert sum(a["records"] for a in actors.values()) == N - 1


def test_bad_record_with_error_fails_naming_it(ray_cluster, tmp_path):
    spec_path = write_case(tmp_path, "parquet", on_bad_record="error")
    result = run_ray_cli(spec_path)
    assert result.exit_code == 2
    assert f"record 'r{BAD}'" in result.output and "outside range" in result.output
    assert "on_bad_record: skip" in result.output and "Traceback" not in result.output
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    jsonschema.validate(m, MANIFEST_SCHEMA)
    assert m["status"] == "failed" and f"r{BAD}" in m["error"]


def test_refusals_before_any_ray_work(tmp_path, write_spec):
    result = run_ray_cli(write_spec(name="mlp.yaml"), "--set", "output.format=npy")
    assert result.exit_code == 2 and "output.format npy has no Ray writer" in result.output
    spec_path = write_case(tmp_path, "parquet")
    result = run_ray_cli(spec_path, "--resume")
    assert result.exit_code == 2 and "--resume is not supported with --ray" in result.output
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = run_ray_cli(spec_path, "--overwrite")
    assert result.exit_code == 2 and "notes.txt" in result.output
    assert (out / "notes.txt").read_text() == "mine" and sorted(out.iterdir()) == [
        out / "notes.txt"]
    # a whole-file problem is one process's message: strings in a numeric column, which
    # Ray's reader would have turned into numbers
    rows = records()
    pq.write_table(pa.table({**{k: [r[k] for r in rows] for k in rows[0]},
                             "x": [[str(v) for v in r["x"]] for r in rows]}),
                   tmp_path / "data.parquet")
    result = run_ray_cli(spec_path, "--overwrite")
    assert result.exit_code == 2, result.output
    assert "column 'x' holds string; expected float32 numbers" in result.output


def test_without_ray_names_the_extra(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    # a patch: Ray missing is the environment's (the import system's)
    monkeypatch.setattr(builtins, "__import__", no_ray)
    result = run_ray_cli(write_case(tmp_path, "parquet"))
    assert result.exit_code == 2
    assert 'pip install -e ".[ray]"' in result.output and "Traceback" not in result.output
    with pytest.raises(graphrun.GraphrunError, match=r'pip install -e "\.\[ray\]"'):
        graphrun.ray.dataset_map(graphrun.load_spec(tmp_path / "pipeline.yaml"), None)


def test_files_renamed_in_task_order_and_owned_for_overwrite(tmp_path):
    """Without Ray: the writers' names sort by task, then part within it (numerically), and
    the renamed files are graphrun's own to --overwrite."""
    from graphrun.write.folder import prepare_out_dir
    from graphrun.scale.ray.run import rename_in_order

    out = tmp_path / "out"
    fingerprint = {"spec_sha256": "a" * 64, "slice": [0, None], "shards": ["parquet"]}
    prepare_out_dir(out, resume=False, overwrite=False, fingerprint=fingerprint)
    uid = "0123456789abcdef0123456789abcdef"
    written = [f"part-00010-{uid}-0.parquet", f"part-00002-{uid}-10.parquet",
               f"part-00002-{uid}-9.parquet", f"part-00001-{uid}-0.parquet"]
    for k, name in enumerate(written):
        (out / name).write_text(name)
    renamed = rename_in_order(out)
    assert [p.name for p in renamed] == [f"part-0000{k}.parquet" for k in range(4)]
    assert [p.read_text() for p in renamed] == [written[3], written[2], written[1], written[0]]
    prepare_out_dir(out, resume=False, overwrite=True, fingerprint=fingerprint)
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]


def test_a_ray_run_killed_while_writing_is_overwritten(tmp_path):
    """Ray's writers' files not renamed yet (the driver killed while they wrote) are graphrun's
    in a Ray run's folder (its run.json, written before them, says so): --overwrite replaces
    them. In a folder of another run they stay someone else's."""
    from graphrun.base.errors import OutputError
    from graphrun.write.folder import prepare_out_dir

    uid = "0123456789abcdef0123456789abcdef"
    ray_run = {"spec_sha256": "a" * 64, "slice": [0, None], "shards": ["jsonl"], "ray": True}
    plain = {"spec_sha256": "a" * 64, "slice": [0, None], "shards": ["jsonl"]}
    for fingerprint, owned in ((ray_run, True), (plain, False)):
        out = tmp_path / str(owned)
        prepare_out_dir(out, resume=False, overwrite=False, fingerprint=fingerprint)
        (out / f"part-00000-{uid}.jsonl").write_text('{"id": "r0"}\n')
        (out / f"part-00001-{uid}-2.jsonl").write_text('{"id": "r9"}\n')
        with pytest.raises(OutputError, match="pass --resume to continue it or --overwrite"
                           if owned else "files graphrun did not write"):
            prepare_out_dir(out, resume=False, overwrite=not owned, fingerprint=fingerprint)
        if owned:
            prepare_out_dir(out, resume=False, overwrite=True, fingerprint=fingerprint)
            assert sorted(p.name for p in out.iterdir()) == ["run.json"]


def test_a_generation_spec_is_refused_before_any_ray_work(tmp_path, monkeypatch):
    from tests.test_generate_job import write_spec as write_generation_spec

    monkeypatch.chdir(tmp_path)
    path = write_generation_spec(tmp_path, n=4, output={"dir": "out", "format": "jsonl"})
    result = run_ray_cli(path)
    assert result.exit_code == 2, result.output
    assert "a generation job (generate:) does not run with --ray" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


SLOW_MODEL = MODEL + '''

_build = build


def build():
    import time
    from pathlib import Path

    model = _build()
    forward = model.forward

    def slow(*args, **kwargs):
        (Path(__file__).parent / "streaming").touch()
        time.sleep(0.3)
        return forward(*args, **kwargs)

    model.forward = slow
    return model
'''


def test_sigterm_to_a_ray_run_writes_an_interrupted_manifest_and_exits_143(ray_cluster,
                                                                            tmp_path):
    """docs/guarantees.md: SIGTERM while streaming ends the run with exit 143 and a manifest
    that says interrupted (Ray's own handler would exit 15 without one). The child joins this
    file's cluster (RAY_ADDRESS) instead of starting one of its own: ray.init puts in its
    SIGTERM handler when it joins one too, so the run must still take SIGTERM back."""
    import signal
    import subprocess
    import sys
    import time

    spec_path = write_case(tmp_path, "jsonl")
    (tmp_path / "model.py").write_text(SLOW_MODEL)
    from tests.children import child_env

    env = {**child_env(), "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    proc = subprocess.Popen([sys.executable, "-m", "graphrun", "run", str(spec_path), "--ray",
                             "--workers", "1", "-q"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "streaming").exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "the actor never ran a batch"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out
    assert "interrupted by SIGTERM" in out and "--overwrite" in out, out
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    jsonschema.validate(m, MANIFEST_SCHEMA)
    assert m["status"] == "interrupted" and "SIGTERM" in m["error"]
