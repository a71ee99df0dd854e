"""The README's walk-through runs as written: every block marked `<!-- readme-test: ... -->` is
written (file NAME), run (run: bash; python: python3) or compared (expect: each line appears
in what the run before it printed), in order, in one empty folder, on the CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARKED = re.compile(r"<!-- readme-test: (file (?P<name>\S+)|run|python|expect) -->\n"
                    r"```(?P<lang>\w+)\n(?P<body>.*?)```", re.DOTALL)


def blocks(text: str) -> list[tuple[str, str, str]]:
    """(kind, file name or "", body) of each marked block, in order."""
    return [(m.group(1).split()[0], m.group("name") or "", m.group("body"))
            for m in MARKED.finditer(text)]


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def test_every_command_block_of_the_walk_through_is_marked():
    walk = section(README.read_text(), "Your own model in five minutes")
    fences = re.findall(r"```(\w+)\n", walk)
    assert len(fences) == len(blocks(walk)) >= 6, "a block of the walk-through is unmarked"


def test_the_walk_through_runs_as_written(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "graphrun"  # the repository's graphrun, as `pip install -e .` would give
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m graphrun "$@"\n')
    shim.chmod(0o755)
    work = tmp_path / "mine"
    work.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    printed = ""
    for kind, name, body in blocks(section(README.read_text(),
                                           "Your own model in five minutes")):
        if kind == "file":
            (work / name).write_text(body)
            continue
        if kind == "expect":
            for line in filter(str.strip, body.splitlines()):
                assert line in printed.splitlines(), f"{line!r} not printed:\n{printed}"
            continue
        cmd = ["bash", "-euo", "pipefail", "-c", body] if kind == "run" else \
            [sys.executable, "-c", body]
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, f"{body}\n{proc.stdout}\n{proc.stderr}"
        printed = proc.stdout
    assert (work / "pipeline.schema.json").is_file()
    written = {p.name for p in (work / "runs" / "classifier").iterdir()}
    assert {"manifest.json", "part-00000.parquet"} <= written


def test_the_spec_reference_markers_are_intact():
    from graphrun.manifest.schema import REF_END, REF_START

    text = README.read_text()
    assert text.count(REF_START) == 1 and text.count(REF_END) == 1
    assert text.index(REF_START) > text.index("\n## Spec reference\n")
