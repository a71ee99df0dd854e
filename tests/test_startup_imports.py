"""What a `graphrun run` process imports: the libraries of other paths stay out of it (a
process's imports are most of a short job's time). Each run is a fresh process of the CLI, its
sys.modules read at its exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

from tests.children import child_env

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "examples" / "models" / "tiny-llama"
PROMPTS = ROOT / "examples" / "data" / "prompts.jsonl"
# libraries no job below needs: transformers (graphrun's own Llama runs the folder, tokenizers
# reads tokenizer.json), pyarrow (Parquet only), plotly (report.html), jsonschema (`schema`),
# rich; and the other kind of job's engine
ELSEWHERE = ("transformers", "pyarrow", "plotly", "jsonschema", "rich")

# the CLI as `python -m graphrun` runs it, with the normal exit (GRAPHRUN_SLOW_EXIT) so that an
# exit hook can print the modules asked for
DRIVER = """
import atexit, json, os, runpy, sys
asked = json.loads(os.environ["ASKED"])
atexit.register(lambda: print("MODULES", json.dumps([m for m in asked if m in sys.modules])))
sys.argv = ["graphrun", *sys.argv[1:]]
runpy.run_module("graphrun", run_name="__main__", alter_sys=True)
"""


def cli_imports(spec: Path, asked: tuple[str, ...], *args: str) -> list[str]:
    """Which of `asked` a `graphrun run SPEC [ARGS]` process has imported at its exit."""
    env = {**child_env(), "ASKED": json.dumps(list(asked)), "GRAPHRUN_SLOW_EXIT": "1"}
    done = subprocess.run([sys.executable, "-c", DRIVER, "run", str(spec), "-q", *args],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stdout.splitlines() if line.startswith("MODULES ")]
    assert said, done.stdout[-2000:]
    return json.loads(said[-1].removeprefix("MODULES "))


def test_a_generation_job_imports_neither_transformers_pyarrow_plotly_nor_the_forward_engine(
        tmp_path):
    lines = PROMPTS.read_text().splitlines()[:6]
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    spec = {"version": 1, "name": "gen", "device": "cpu",
            "model": {"hf": {"path": str(FOLDER), "class": "AutoModelForCausalLM"},
                      "dtype": "float32"},
            "data": {"path": "prompts.jsonl", "id_field": "id",
                     "text": {"field": "prompt", "truncate": True}, "batch_size": 4},
            "generate": {"max_new_tokens": 3, "sampling": {"method": "greedy"}},
            "buckets": {"batch": [4], "seq": [64, 128]},
            "output": {"dir": "out", "format": "jsonl"}}
    path = tmp_path / "gen.yaml"
    path.write_text(yaml.safe_dump(spec))
    asked = (*ELSEWHERE, "graphrun.engine.runner", "tokenizers", "graphrun.generate.runner")
    got = cli_imports(path, asked)
    assert got == ["tokenizers", "graphrun.generate.runner"]  # what it needs, it has
    rows = [json.loads(line) for line in (tmp_path / "out" / "part-00000.jsonl").read_text()
            .splitlines()]
    assert [r["id"] for r in rows] == [json.loads(line)["id"] for line in lines]
    assert all(1 <= r["output_tokens"] <= 3 for r in rows)


def mlp_spec(tmp_path: Path) -> Path:
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((10, 4),
                                                                        dtype=np.float32))
    spec = {"version": 1, "name": "mlp", "device": "cpu",
            "model": {"builtin": "mlp", "args": {"in_features": 4, "hidden": 8, "layers": 1,
                                                 "out_features": 2}},
            "inputs": {"x": {"shape": ["batch", 4], "dtype": "float32"}},
            "outputs": {"scores": {"shape": ["batch", 2], "dtype": "float32"}},
            "buckets": {"batch": [4]}, "data": {"path": "x.npy", "batch_size": 4},
            "output": {"dir": "out", "format": "npy"}}
    path = tmp_path / "mlp.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_forward_pass_over_npy_imports_no_tokenizer_nor_the_generation_engine(tmp_path):
    asked = (*ELSEWHERE, "tokenizers", "graphrun.generate.runner", "graphrun.engine.runner")
    assert cli_imports(mlp_spec(tmp_path), asked) == ["graphrun.engine.runner"]
    scores = np.concatenate([np.load(p) for p in sorted((tmp_path / "out").glob(
        "part-*.scores.npy"))])
    assert scores.shape == (10, 2) and np.isfinite(scores).all()


def test_the_parent_of_a_cpu_job_of_workers_starts_and_merges_them_without_torch(tmp_path):
    # its two workers import torch in their own processes; it only splits, watches and merges
    asked = ("torch", "graphrun.engine.runner", "graphrun.feed.loop", "numpy")
    assert cli_imports(mlp_spec(tmp_path), asked, "--gpus", "2") == ["numpy"]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["totals"]["records_out"] == 10
    assert [w["status"] for w in manifest["workers"]] == ["completed", "completed"]
    assert manifest["environment"]["torch"]  # taken from the workers' manifests
