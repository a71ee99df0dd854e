"""The environment of graphrun child processes the tests start."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env() -> dict:
    """This checkout first on the child's path, then whatever path the test process was given
    (site folders outside the venv, as on the GPU machine)."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
