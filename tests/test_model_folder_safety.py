"""A model folder graphrun is given is checked before any work: no Python shipped in it runs
unless the spec allows it (nothing is asked on stdin), and its weights are the model's its
config.json describes: none missing, none left over, each of the model's shape and dtype, on
every path (graphrun's own code, transformers' class, model.weights)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers")

from tests.children import child_env  # noqa: E402

EVIL_CONFIG = """import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import PretrainedConfig


class EvilConfig(PretrainedConfig):
    model_type = "evil"
"""


def cli(*args, stdin: str = "", cwd=None):
    return subprocess.run([sys.executable, "-m", "graphrun", *map(str, args)], input=stdin,
                          cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=300)


def evil_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A folder whose config.json maps AutoConfig to its own configuration_evil.py, which
    writes a marker file when imported."""
    folder, marker = tmp_path / "evil", tmp_path / "MARKER"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "evil", "architectures": ["EvilModel"],
        "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                     "AutoModel": "modeling_evil.EvilModel"}}))
    (folder / "configuration_evil.py").write_text(EVIL_CONFIG.format(marker=str(marker)))
    (folder / "modeling_evil.py").write_text(EVIL_CONFIG.format(marker=str(marker)))
    (folder / "tokenizer.json").write_text("{}")
    return folder, marker


def test_a_folders_own_python_never_runs_without_trust_remote_code_whatever_stdin_says(
        tmp_path):
    folder, marker = evil_folder(tmp_path)
    (tmp_path / "texts.jsonl").write_text('{"id": 1, "text": "hello"}\n')
    spec = {"version": 1, "name": "evil", "device": "cpu",
            "model": {"hf": {"path": str(folder), "class": "AutoModel"}},
            "inputs": {"input_ids": {"shape": ["batch", "seq"], "dtype": "int64"}},
            "outputs": {"last_hidden_state": {"shape": ["batch", "seq", 4]}},
            "buckets": {"batch": [1], "seq": [8]},
            "data": {"path": str(tmp_path / "texts.jsonl"), "text": {"field": "text"}},
            "output": {"dir": str(tmp_path / "out"), "format": "jsonl"}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    for proc in (cli("run", tmp_path / "s.yaml", stdin="y\n" * 20),
                 cli("init", "--hf", folder, "--data", tmp_path / "texts.jsonl", "-o",
                     tmp_path / "init.yaml", stdin="y\n" * 20)):
        assert proc.returncode != 0, proc.stdout
        assert "Traceback" not in proc.stderr, proc.stderr
        assert "configuration_evil.py" in proc.stderr and "trust_remote_code" in proc.stderr
        assert "[y/N]" not in proc.stdout + proc.stderr
        assert not marker.exists()


def test_a_known_model_type_with_an_auto_map_loads_with_transformers_own_class(tmp_path):
    from graphrun.models.hf import refuse_remote_code

    folder, marker = evil_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    refuse_remote_code(str(folder), "model.hf", "allow it")  # bert's class is transformers'
    assert not marker.exists()
