"""A new user's mistakes (issue 20): each meets one clear message that names where and what
to do, and every remedy a message prints works."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main

# A model of the user's own: a linear scorer that checks its input inside forward (raising
# for a record whose first value is 50 while the file "broken" sits beside it), and can be
# made to mix the rows of its batch, or return the wrong number of rows.
MODEL = '''\
from pathlib import Path

import torch

BROKEN = Path(__file__).with_name("broken")


class Scorer(torch.nn.Module):
    def __init__(self, mix=False, rows=None):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.mix, self.rows = mix, rows

    def forward(self, x):
        if BROKEN.exists() and bool((x[:, 0] == 50).any()):
            raise ValueError("record with x[0] == 50 is not allowed")
        y = self.lin(x)
        if self.mix:  # every row sees the batch's mean: padded rows move real ones
            y = y + x.mean(0, keepdim=True)[:, :3]
        if self.rows is not None:
            y = y[: self.rows]
        return y


def build(**args):
    return Scorer(**args)
'''


def spec_dict(**data) -> dict:
    return {
        "version": 1, "name": "user", "device": "cpu",
        "model": {"target": "model.py:build"},
        "inputs": {"x": {"shape": ["batch", 4], "dtype": "float32"}},
        "outputs": {"y": {"shape": ["batch", 3]}},
        "buckets": {"batch": [1, 4, 8]},
        "capture": {"warmup_iters": 1},
        "data": {"path": "data.jsonl", "id_field": "id", "batch_size": 8, **data},
        "output": {"dir": "out", "format": "npy", "rows_per_file": 16},
    }


def make_job(folder: Path, spec: dict | None = None, n: int = 100, broken: bool = False) -> Path:
    (folder / "model.py").write_text(MODEL)
    (folder / "data.jsonl").write_text("".join(
        json.dumps({"id": f"r{i}", "x": [i, 1, 2, 3]}) + "\n" for i in range(n)))
    if broken:
        (folder / "broken").touch()
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec or spec_dict(), sort_keys=False))
    return path


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def ids_written(out: Path) -> list[str]:
    import numpy as np
    return [str(i) for f in sorted(out.glob("part-*.ids.npy")) for i in np.load(f).tolist()]


# ---- 1. a model that raises partway through a run --------------------------------------------

@pytest.mark.parametrize("on_bad_record", ["error", "skip"])
@pytest.mark.parametrize("overlap", ["on", "off"])
def test_a_model_raising_mid_run_names_the_batch_and_resume_continues(
        tmp_path, monkeypatch, on_bad_record, overlap):
    monkeypatch.setenv("GRAPHRUN_OVERLAP", overlap)
    spec = make_job(tmp_path, spec_dict(on_bad_record=on_bad_record), broken=True)
    result = cli("run", spec, "-q")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert "Traceback" not in result.output and len(lines) <= 4, result.output
    # records 48..55 are the batch that holds record 50 (batches of 8)
    assert lines[0].startswith("error: the model raised on the batch of 8 records from "
                               "data.jsonl:49 (ids r48, r49, r50, ... r55) "
                               "in bucket batch=8: ValueError: record with x[0] == 50")
    assert f"at {tmp_path / 'model.py'}:16 in forward" in lines[1]
    out = tmp_path / "out"
    m = manifest(out)
    assert m["status"] == "failed" and m["error"] == result.output.strip()[len("error: "):]
    assert ids_written(out) == [f"r{i}" for i in range(48)]  # all before the batch, committed
    (tmp_path / "broken").unlink()  # the model fixed
    result = cli("run", spec, "-q", "--resume")
    assert result.exit_code == 0, result.output
    assert ids_written(out) == [f"r{i}" for i in range(100)]
    assert manifest(out)["status"] == "completed"


def test_a_model_fixed_in_its_source_resumes_only_with_accept_model_change(tmp_path):
    """Issue 21 covers the model's files by the resume fingerprint; issue 20's fix-and-resume
    then takes --accept-model-change, which the model error names."""
    spec = make_job(tmp_path, spec_dict(on_bad_record="skip"))
    model = tmp_path / "model.py"
    model.write_text(MODEL.replace("if BROKEN.exists() and", "if"))  # broken in its source
    result = cli("run", spec, "-q")
    assert result.exit_code == 2, result.output
    assert ("fix the model, then run again with --resume --accept-model-change to continue "
            "from this batch") in " ".join(result.output.split())
    model.write_text(MODEL)  # the fix: a change that does not alter the outputs
    result = cli("run", spec, "-q", "--resume")
    assert result.exit_code != 0 and "Traceback" not in result.output
    said = " ".join(result.output.split())
    assert f"the model's source file {model} changed since the run started" in said, said
    assert "add --accept-model-change; otherwise use --overwrite" in said
    result = cli("run", spec, "-q", "--resume", "--accept-model-change")
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    assert ids_written(out) == [f"r{i}" for i in range(100)]
    assert manifest(out)["status"] == "completed"
    # run.json took the fixed model's hash: a plain --resume now finds the run complete
    result = cli("run", spec, "--resume")
    assert result.exit_code == 0 and "already complete" in result.output, result.output


# ---- 2. every remedy printed for a failed verification works ----------------------------------

def remedies_of(output: str) -> list[str]:
    return [line.split(". ", 1)[1] for line in output.splitlines()
            if line.strip()[:2] in ("1.", "2.", "3.", "4.")]


@pytest.mark.parametrize("on_failure", ["error", "eager"])
def test_pad_isolation_failure_offers_only_remedies_that_work(tmp_path, on_failure):
    mixing = spec_dict()
    mixing["model"]["args"] = {"mix": True}
    mixing["capture"]["on_failure"] = on_failure
    mixing["capture"]["verify"] = {"eager": True}  # the CPU: no replay, the model's own checks
    spec = make_job(tmp_path, mixing)
    result = cli("run", spec, "-q", "--overwrite")
    assert result.exit_code == 2 and "padded rows change real rows" in result.output
    assert "Traceback" not in result.output
    remedies = remedies_of(result.output)
    assert len(remedies) == 2 and not any("on_failure" in r for r in remedies), result.output
    if on_failure == "eager":
        assert "capture.on_failure: eager does not help here" in result.output
    # remedy 1: the model fixed (rows independent)
    assert cli("run", spec, "-q", "--overwrite", "--set", "model.args.mix=false").exit_code == 0
    # remedy 2: one record per batch, unpadded
    result = cli("run", spec, "-q", "--overwrite", "--set", "buckets.batch=[1]",
                 "--set", "data.batch_size=1")
    assert result.exit_code == 0, result.output
    assert manifest(tmp_path / "out")["totals"]["records_out"] == 100


NOISY = '''\
import torch


class Noisy(torch.nn.Module):
    def __init__(self, noise=0.01):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.noise = noise

    def forward(self, x):
        return self.lin(x) + self.noise * torch.rand(x.shape[0], 3)


def build(**args):
    return Noisy(**args)
'''


def test_an_eager_bucket_that_differs_from_itself_offers_remedies_that_work(tmp_path):
    """On the CPU a bucket runs eagerly, so replay vs eager differ only if the model does
    from call to call: on_failure: eager cannot help, and is not offered."""
    checked = spec_dict()
    checked["capture"]["verify"] = {"eager": True}  # the CPU: no replay, the model's own checks
    spec = make_job(tmp_path, checked)
    (tmp_path / "model.py").write_text(NOISY)
    result = cli("run", spec, "-q")
    assert result.exit_code == 2 and "replay differs from eager" in result.output
    remedies = remedies_of(result.output)
    assert remedies[0].startswith("make forward deterministic") and len(remedies) == 2
    assert not any("on_failure" in r for r in remedies)
    result = cli("run", spec, "-q", "--overwrite", "--set", "model.args.noise=0")
    assert result.exit_code == 0, result.output
    result = cli("run", spec, "-q", "--overwrite", "--set", "capture.verify.atol=0.1")
    assert result.exit_code == 0, result.output


# ---- 3. the model's first call: the hint that fits -------------------------------------------

@pytest.mark.parametrize("change, says, not_says", [
    # keyword: an input named unlike forward's parameter
    ({"inputs": {"inp": {"shape": ["batch", 4], "dtype": "float32"}}},
     "name the inputs after forward's parameters (x), or set model.call: positional", None),
    # positional already: one input too many
    ({"model": {"target": "model.py:build", "call": "positional"},
      "inputs": {"x": {"shape": ["batch", 4], "dtype": "float32"},
                 "z": {"shape": ["batch", 4], "dtype": "float32"}}},
     "model.call is positional: forward gets the 2 inputs", "set model.call: positional"),
    # an integer input where the model computes in floats
    ({"inputs": {"x": {"shape": ["batch", 4], "dtype": "int64", "range": [0, 100]}}},
     "set inputs.<name>.dtype to what forward expects", "set model.call: positional"),
])
def test_the_first_call_failure_says_the_change_that_fits(tmp_path, change, says, not_says):
    raw = spec_dict()
    raw.update(change)
    result = cli("run", make_job(tmp_path, raw), "-q")
    assert result.exit_code == 2 and "the model failed on its first call" in result.output
    assert says in result.output, result.output
    assert not_says is None or not_says not in result.output
    assert "Traceback" not in result.output


def test_floating_inputs_are_cast_to_the_models_dtype(tmp_path):
    raw = spec_dict()
    raw["model"]["dtype"] = "bfloat16"  # float32 inputs in the file and the buffers
    spec = make_job(tmp_path, raw)
    result = cli("run", spec, "-q")
    assert result.exit_code == 0, result.output
    import numpy as np
    y = np.concatenate([np.load(f) for f in sorted((tmp_path / "out").glob("part-*.y.npy"))])
    assert y.shape == (100, 3) and np.isfinite(y).all()


# ---- 4. the wrong batch size is the model's fault -------------------------------------------

def test_a_model_returning_the_wrong_batch_size_is_told_the_model_is_wrong(tmp_path):
    raw = spec_dict()
    raw["model"]["args"] = {"rows": 1}
    result = cli("run", make_job(tmp_path, raw), "-q")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "the model returned 1 rows for a batch of 8" in result.output
    assert "fix the model's forward, not the spec" in result.output
    assert "fix outputs.y.shape" not in result.output


# ---- 5. validate: the target's file; --load calls the model ---------------------------------

def test_validate_checks_that_the_targets_file_exists(tmp_path):
    raw = spec_dict()
    raw["model"]["target"] = "cnnx.py:build"
    spec = make_job(tmp_path, raw)
    result = cli("validate", spec)
    assert result.exit_code == 1 and "model.target: file not found" in result.output
    assert "cnnx.py" in result.output
    raw["model"]["target"] = "cnnx_nowhere.net:build"
    spec.write_text(yaml.safe_dump(raw, sort_keys=False))
    result = cli("validate", spec)
    assert result.exit_code == 1 and "module 'cnnx_nowhere' not found" in result.output


def test_validate_load_builds_the_model_and_calls_it_per_bucket(tmp_path):
    spec = make_job(tmp_path)
    result = cli("validate", "--load", spec)
    assert result.exit_code == 0, result.output
    assert "ok (model built, called on each of 3 buckets)" in result.output
    assert not (tmp_path / "out").exists()  # nothing run, nothing written
    raw = spec_dict()
    raw["model"]["args"] = {"rows": 1}
    spec.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert cli("validate", spec).exit_code == 0  # the spec itself is fine
    result = cli("validate", "--load", spec)
    assert result.exit_code == 1 and "the model returned 1 rows" in result.output


# ---- 6. --debug after the verb ------------------------------------------------------------

def test_debug_is_accepted_after_the_verb(tmp_path):
    """--debug before the verb or after it: the user error (here the model's, found while
    running or while validating with --load) is raised out of the command with its traceback
    instead of ending as one line. In this process: the exception itself; the traceback a
    real process then prints is tests/test_cli.py's (both places of --debug)."""
    from graphrun.base.errors import GraphrunError, set_debugging

    raw = spec_dict()
    raw["model"]["args"] = {"rows": 1}
    spec = make_job(tmp_path, raw)
    try:
        for args in (["--debug", "run", spec, "-q"], ["run", spec, "--debug", "-q"],
                     ["validate", "--load", spec, "--debug"]):
            result = cli(*args)
            assert result.exit_code != 0, (args, result.output)
            assert isinstance(result.exception, GraphrunError), (args, result.exception)
            assert "the model returned 1 rows" in str(result.exception), (args, result.exception)
            assert "No such option" not in result.output
    finally:
        set_debugging(False)  # the flag is this process's: no later test may inherit it


# ---- 9. a dict output the spec does not list ------------------------------------------------

def test_an_unlisted_dict_output_is_warned_of_once(tmp_path):
    spec = make_job(tmp_path, n=20)
    (tmp_path / "model.py").write_text(MODEL.replace(
        "        return y\n", "        return {'y': y, 'hidden': y * 2}\n"))
    result = cli("run", spec)
    assert result.exit_code == 0, result.output
    warned = [w for w in manifest(tmp_path / "out")["warnings"] if "hidden" in w]
    assert warned == ["the model also returns hidden, which outputs does not list: not "
                      "written; list it under outputs to keep it"]
    assert result.output.count("also returns hidden") == 1


EMBED = '''\
import torch


class Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 3)

    def forward(self, tokens):
        return self.emb(tokens).sum(1)


def build():
    return Bag()
'''


def embed_job(folder: Path, token_range, pad=0) -> Path:
    (folder / "model.py").write_text(EMBED)
    (folder / "data.jsonl").write_text("".join(
        json.dumps({"id": f"r{i}", "tokens": [i % 50, 1, 2]}) + "\n" for i in range(20)))
    spec = {**spec_dict(), "inputs": {"tokens": {"shape": ["batch", 3], "dtype": "int64",
                                                 "range": token_range, "pad": pad}},
            "outputs": {"y": {"shape": ["batch", 3]}}}
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_validate_rejects_a_pad_outside_the_inputs_range(tmp_path):
    result = cli("validate", embed_job(tmp_path, [0, 50], pad=-1))
    assert result.exit_code == 1, result.output
    assert "inputs.tokens.pad: pad -1 lies outside range [0, 50)" in result.output


def test_an_index_past_the_models_table_names_the_range_pad_and_the_table(tmp_path):
    result = cli("run", embed_job(tmp_path, [0, 7001]))
    assert result.exit_code != 0 and "Traceback" not in result.output
    text = " ".join(result.output.split())
    assert "IndexError" in text
    assert "inputs.tokens range [0, 7001), pad 0" in text
    assert "the model's nn.Embedding tables hold 50 rows" in text
    assert "match the model's forward" not in text


def test_resume_with_other_settings_names_the_keys_and_how_to_repeat_them(tmp_path):
    spec = make_job(tmp_path, broken=True)
    first = cli("run", spec, "-q", "--set", "output.rows_per_file=8")
    assert first.exit_code == 2, first.output
    (tmp_path / "broken").unlink()
    again = cli("run", spec, "-q", "--resume")  # the --set forgotten
    assert again.exit_code == 2, again.output
    text = " ".join(again.output.split())
    assert "output.rows_per_file was 8, now 16" in text
    assert "--set output.rows_per_file=8" in text
    assert "spec_sha256" not in text
    done = cli("run", spec, "-q", "--resume", "--set", "output.rows_per_file=8")
    assert done.exit_code == 0, done.output
    assert ids_written(tmp_path / "out") == [f"r{i}" for i in range(100)]


def test_an_index_error_mid_run_names_the_range_and_pad_not_the_models_code(tmp_path):
    path = embed_job(tmp_path, [0, 50])
    (tmp_path / "model.py").write_text(EMBED.replace(
        "        return self.emb(tokens).sum(1)",
        "        if bool((tokens == 45).all(1).any()):  # as a table one row short would\n"
        "            raise IndexError('index out of range in self')\n"
        "        return self.emb(tokens).sum(1)"))
    with open(tmp_path / "data.jsonl", "a") as f:
        f.write(json.dumps({"id": "r45", "tokens": [45, 45, 45]}) + "\n")
    result = cli("run", path, "-q")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    text = " ".join(result.output.split())
    assert "the model raised on the batch of 5 records from data.jsonl:17" in text
    assert "inputs.tokens range [0, 50), pad 0; the model's nn.Embedding tables hold 50 rows" \
        in text
    assert "fix the model" not in text and "--overwrite" in text


def test_an_exception_in_one_line_even_without_a_message():
    from graphrun.base.errors import first_line, first_message

    assert first_line(ValueError("bad shape\n  at layer 3")) == "ValueError: bad shape"
    assert first_line(RuntimeError()) == "RuntimeError"  # an empty message raised IndexError
    assert first_message(AssertionError()) == ""
    assert first_message(OSError("  no config.json  \nmore")) == "no config.json"
    assert len(first_line(ValueError("x" * 1000), limit=40)) == 40


# ---- a slice that ends before it starts, a spec's path where a spec is taken ---------------

@pytest.mark.parametrize("gpus", [[], ["--gpus", "2"]])
def test_stop_before_start_is_refused_before_any_work(tmp_path, gpus):
    """--start 10 --stop 5 was a ValueError traceback after setup (a failed manifest left in
    the folder); with --gpus 2 it completed 0 records."""
    path = make_job(tmp_path)
    result = cli("run", path, "--start", 10, "--stop", 5, "--out", tmp_path / "o", *gpus)
    assert result.exit_code == 2, result.output
    assert "--stop 5 is before --start 10: give --stop at least --start" in result.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("slice_", [{"start": 10, "stop": 5}, {"start": -1}, {"start": "3"},
                                    {"start": 0, "stop": 2.5}])
def test_graphrun_run_refuses_a_bad_slice_or_a_path_before_any_work(tmp_path, slice_):
    """start="3" was a TypeError out of the check (str < int)."""
    path = make_job(tmp_path)
    with pytest.raises(graphrun.GraphrunError, match=r"give 0 <= start <= stop"):
        graphrun.run(graphrun.load_spec(path), out=tmp_path / "o", **slice_)
    with pytest.raises(graphrun.GraphrunError, match=r"graphrun.run takes a PipelineSpec, got "
                                                     r"str: graphrun.load_spec\(path\)"):
        graphrun.run(str(path), out=tmp_path / "o")
    assert not (tmp_path / "o").exists()
