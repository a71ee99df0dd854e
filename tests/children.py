"""The environment of graphrun child processes the tests start."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env() -> dict:
    """This checkout first on the child's path, then whatever path the test process was given
    (site folders outside the venv, as on the GPU machine)."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def imports_transformers(spec) -> bool:
    """Whether graphrun.run of this spec file, in a child process, imports transformers."""
    return imports_of(spec, "transformers")["transformers"]


def imports_of(spec, *modules: str) -> dict[str, bool]:
    """Which of these modules graphrun.run of this spec file imports, in a child process."""
    import subprocess
    import sys

    code = ("import sys, graphrun\n"
            f"graphrun.run(graphrun.load_spec({str(spec)!r}))\n"
            f"print([m in sys.modules for m in {list(modules)!r}])\n")
    done = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    said = done.stdout.strip().splitlines()[-1]
    return dict(zip(modules, (flag == "True" for flag in said.strip("[]").split(", "))))
