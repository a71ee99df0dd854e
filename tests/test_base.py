"""base/: the helpers every layer shares (a file's sha256, the error chain, the wall clock, the
install hint of an extra)."""

import ast
import hashlib
import re
from importlib import metadata
from pathlib import Path

import pytest

from graphrun.base.digest import file_sha256
from graphrun.base.extras import extras, install_hint
from graphrun.base.errors import error_chain
from graphrun.base.phases import utc_now

ROOT = Path(__file__).resolve().parent.parent


def test_a_file_s_sha256_whole_and_of_its_first_bytes(tmp_path):
    path = tmp_path / "f.bin"
    data = bytes(range(256)) * 9000  # past one block of a MiB
    path.write_bytes(data)
    assert file_sha256(path).hexdigest() == hashlib.sha256(data).hexdigest()
    assert file_sha256(path, 1_500_000).hexdigest() == hashlib.sha256(data[:1_500_000]).hexdigest()
    # nothing to read: a file that is not there yet hashes as empty
    assert file_sha256(tmp_path / "none", 0).hexdigest() == hashlib.sha256().hexdigest()


def test_the_error_chain_follows_context_cause_and_a_wrapper_s_cause_once_each():
    class Wrapped(Exception):  # as Ray wraps an actor's error
        def __init__(self, cause):
            super().__init__("wrapped")
            self.cause = cause

    inner = ValueError("inner")
    try:
        try:
            raise inner
        except ValueError as e:
            raise KeyError("middle") from e
    except KeyError as e:
        middle = e
    outer = Wrapped(middle)
    assert error_chain(outer) == [outer, middle, inner]
    inner.__context__ = middle  # a loop ends at the first error seen again
    assert error_chain(middle) == [middle, inner]
    assert error_chain(None) == []


def test_utc_now_is_an_iso_time_to_the_second():
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", utc_now())


def pyproject_extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    text = (ROOT / "pyproject.toml").read_text()
    return tomllib.loads(text)["project"]["optional-dependencies"]


def test_every_install_hint_names_an_extra_pyproject_has():
    extras = pyproject_extras()
    named = []
    for path in sorted((ROOT / "graphrun").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "install_hint":
                assert isinstance(node.args[0], ast.Constant), f"{path}: name the extra literally"
                named.append((path.name, node.args[0].value))
    assert {extra for _, extra in named} >= {"hf", "vision", "ray", "report", "plan", "fast"}
    assert [(f, e) for f, e in named if e not in extras] == []


def test_no_install_command_names_graphrun_as_a_distribution():
    # graphrun is installed from its clone: no package index knows the name with an extra
    pages = [ROOT / "README.md"] + [
        path for folder in ("graphrun", "tests", "examples", "pipelines", "scripts", "docs")
        for path in sorted((ROOT / folder).rglob("*"))
        if path.suffix in (".py", ".yaml", ".md", ".sh")]
    found = [f"{path.relative_to(ROOT)}: {m}" for path in pages
             for m in re.findall(r"graphrun\[\w+\]", path.read_text())]
    assert found == []


def test_the_install_hint_gives_the_clone_s_command_and_the_extra_s_packages(monkeypatch):
    # a patch: the installed metadata is the environment's (importlib.metadata)
    monkeypatch.setattr(metadata, "requires", lambda name: [
        "torch>=2.4", 'transformers>=4.40; extra == "hf"', "tokenizers>=0.15 ; extra == 'hf'",
        'ray[data]>=2.50; extra == "ray"'])
    extras.cache_clear()
    try:
        assert install_hint("hf") == ('pip install -e ".[hf]" in the graphrun clone '
                                      "(or: pip install transformers tokenizers)")
        assert install_hint("ray").endswith('(or: pip install "ray[data]")')  # the shell's brackets
    finally:
        extras.cache_clear()


def test_the_installed_extras_are_pyproject_s():
    if not extras():
        pytest.skip("graphrun is not installed (run from the clone)")
    assert set(extras()) == set(pyproject_extras())
