"""The README's and docs/'s commands run as written, on the CPU.

A block marked `<!-- readme-test: ... -->` is:
    file NAME  written into the folder the blocks run in
    run        run there by bash; python: by python3
    expect     compared: each of its lines appears in what the run before it printed
    repo       a bash block run from the repository's root, in a fresh copy of pipelines/ and
               examples/ (so that its outputs land in the copy), with the expect blocks after it

The walk-through of the README ("Your own model in five minutes") runs in order, in one empty
folder. Every other page's marked blocks run where they are marked, one test each. Besides,
every `graphrun VERB ...` line of a code block names a verb and options that exist.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# end to end: processes, real models, whole runs (`pytest -m "not slow"` leaves them out)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
MARKED = re.compile(r"<!-- readme-test: (file (?P<name>\S+)|run|python|expect|repo) -->\n"
                    r"```(?P<lang>\w+)\n(?P<body>.*?)```", re.DOTALL)
FENCE = re.compile(r"^```\w*\n(.*?)^```", re.DOTALL | re.MULTILINE)
WALK = "Your own model in five minutes"
# the one command that needs a file from another branch: the generation job's shipped spec
GENERATE_SPEC = ROOT / "pipelines" / "generate.yaml"


def blocks(text: str) -> list[tuple[str, str, str]]:
    """(kind, file name or "", body) of each marked block, in order."""
    return [(m.group(1).split()[0], m.group("name") or "", m.group("body"))
            for m in MARKED.finditer(text)]


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def shim_env(tmp_path: Path) -> dict:
    """PATH with a `graphrun` that is the repository's (as `pip install -e .` gives), no GPU."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "graphrun"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m graphrun "$@"\n')
    shim.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}


def run_block(kind: str, body: str, cwd: Path, env: dict) -> str:
    cmd = ["bash", "-euo", "pipefail", "-c", body] if kind in ("run", "repo") else \
        [sys.executable, "-c", body]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{body}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def expect(body: str, printed: str) -> None:
    for line in filter(str.strip, body.splitlines()):
        assert line.strip() in printed, f"{line!r} not printed:\n{printed}"


def test_every_command_block_of_the_walk_through_is_marked():
    walk = section(README.read_text(), WALK)
    fences = re.findall(r"```(\w+)\n", walk)
    assert len(fences) == len(blocks(walk)) >= 6, "a block of the walk-through is unmarked"


def test_the_walk_through_runs_as_written(tmp_path):
    env = shim_env(tmp_path)
    work = tmp_path / "mine"
    work.mkdir()
    printed = ""
    for kind, name, body in blocks(section(README.read_text(), WALK)):
        if kind == "file":
            (work / name).write_text(body)
        elif kind == "expect":
            for line in filter(str.strip, body.splitlines()):
                assert line in printed.splitlines(), f"{line!r} not printed:\n{printed}"
        else:
            printed = run_block(kind, body, work, env)
    assert (work / "pipeline.schema.json").is_file()
    written = {p.name for p in (work / "runs" / "classifier").iterdir()}
    assert {"manifest.json", "part-00000.parquet"} <= written


def repo_blocks() -> list:
    """One pytest param per `repo` block of every page: (body, the expect blocks after it)."""
    found = []
    for page in PAGES:
        current = None
        for kind, _, body in blocks(page.read_text()):
            if kind == "repo":
                current = (body, [])
                found.append(pytest.param(*current, id=f"{page.name}: {body.splitlines()[0]}"))
            elif kind == "expect" and current is not None:
                current[1].append(body)
            else:
                current = None
    return found


@pytest.mark.parametrize("body, expects", repo_blocks())
def test_a_repository_command_runs_as_written(body, expects, tmp_path):
    if "pipelines/generate.yaml" in body and not GENERATE_SPEC.is_file():
        pytest.skip("pipelines/generate.yaml is absent: the generation job's spec comes with "
                    "its integration")
    copy = tmp_path / "repo"
    for folder in ("pipelines", "examples", "schemas"):
        shutil.copytree(ROOT / folder, copy / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "runs"))
    printed = run_block("repo", body, copy, shim_env(tmp_path))
    for want in expects:
        expect(want, printed)


def test_the_pages_have_repository_commands():
    ids = [p.id for p in repo_blocks()]
    for wanted in ("pipelines/decoder-step.yaml", "pipelines/minilm-embed.yaml",
                   "pipelines/generate.yaml", "graphrun plan"):
        assert any(wanted in i for i in ids), f"no repo block runs {wanted}: {ids}"


def command_lines() -> list:
    """Every `graphrun VERB ...` line of a code block of the README and docs/ (a shell prompt
    `$ ` and a trailing comment taken off, continued lines joined)."""
    found = []
    for page in PAGES:
        for fence in FENCE.findall(page.read_text()):
            text = fence.replace("\\\n", " ")
            for line in text.splitlines():
                line = line.strip().removeprefix("$ ")
                line = line.removeprefix("torchrun --nproc-per-node 2 -m ")
                if line.startswith("graphrun "):
                    found.append(pytest.param(line.split(" #")[0],
                                              id=f"{page.name}: {line[:60]}"))
    return found


@pytest.mark.parametrize("line", command_lines())
def test_a_command_line_names_a_verb_and_options_that_exist(line):
    from graphrun.cli.main import main

    words = shlex.split(line.replace("...", ""))
    verb = words[1]
    if verb == "--debug":
        verb = words[2]
    assert verb in main.commands, f"{line}: no verb {verb!r}"
    known = {o for p in main.commands[verb].params for o in (*p.opts, *p.secondary_opts)}
    known |= {"--help", "-h", "--debug"}
    for word in words[2:]:
        option = word.split("=")[0].strip("[]|()")
        if option.startswith("-") and not re.fullmatch(r"-?\d+", option):
            assert option in known, f"{line}: {verb} has no option {option}"


def test_each_page_is_linked_from_the_readme():
    readme = README.read_text()
    for page in sorted(DOCS.glob("*.md")):
        assert f"](docs/{page.name})" in readme, f"README does not link docs/{page.name}"


def test_the_spec_reference_markers_are_intact():
    from graphrun.manifest.schema import REF_END, REF_START, SPEC_PAGE

    text = (ROOT / SPEC_PAGE).read_text()
    assert text.count(REF_START) == 1 and text.count(REF_END) == 1
    assert REF_START not in README.read_text()


def pip_lines() -> list:
    """Every `pip install ...` the README and docs/ give a user, as written."""
    found = []
    for page in PAGES:
        for line in re.findall(r"`((?:python3 -m )?pip install [^`]+)`", page.read_text()):
            found.append(pytest.param(line, id=f"{page.name}: {line[:60]}"))
    return found


@pytest.mark.parametrize("line", pip_lines())
def test_a_pip_line_installs_what_a_clone_can(line):
    """graphrun is installed from its clone, not from an index: its extras are `-e ".[x]"`,
    each one pyproject.toml defines."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    words = shlex.split(line.replace("\n", " "))
    assert not [w for w in words if w.startswith("graphrun")], \
        f"{line}: graphrun is not on an index; install it from the clone (-e \".[extra]\")"
    for word in words:
        if word.startswith(".["):
            assert set(word[2:-1].split(",")) <= set(extras), f"{line}: no such extra"


def test_the_set_up_s_commands_run_in_order_after_the_demo(tmp_path):
    """scripts/demo.sh's run, then the README's next command, in the same folder: the second
    finds the demo's outputs there."""
    demo = [x for x in (ROOT / "scripts" / "demo.sh").read_text().splitlines()
            if x.startswith("python3 -m graphrun run ")]
    assert len(demo) == 1, "demo.sh's run line is not where this test looks"
    copy = tmp_path / "repo"
    for folder in ("pipelines", "examples", "schemas"):
        shutil.copytree(ROOT / folder, copy / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "runs"))
    env = shim_env(tmp_path)
    run_block("run", demo[0].replace('"$@"', "-q"), copy, env)
    printed = ""
    for kind, _, body in blocks(section(README.read_text(), "Set up")):
        if kind == "repo":
            printed = run_block("repo", body, copy, env)
        elif kind == "expect":
            expect(body, printed)
    assert "records in 2000, out 1996, rejected 4" in printed
