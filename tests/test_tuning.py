"""Tuning: sized by the cores, overridden by the GRAPHRUN_* variables envs.py lists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from graphrun.base import envs
from graphrun.base.errors import GraphrunError
from graphrun.base.tuning import Tuning

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("cores,parquet,jsonl,writers", [
    (1, 1, 0, 1), (2, 2, 0, 2), (5, 2, 0, 4), (8, 4, 4, 4), (16, 12, 8, 4), (64, 12, 8, 4)])
def test_pools_are_sized_by_the_cores(cores, parquet, jsonl, writers):
    t = Tuning.from_machine(cores=cores, environ={})
    assert (t.parquet_threads, t.jsonl_workers, t.row_writers) == (parquet, jsonl, writers)
    assert t.text_threads == min(2, cores)
    # read ahead beyond the next batch only where cores are spare for it
    assert t.read_ahead_bytes == (Tuning.read_ahead_bytes if cores >= 6 else 0)


def test_the_environment_overrides_the_cores_and_arguments_override_both():
    env = {"GRAPHRUN_PARQUET_THREADS": " 3 ", "GRAPHRUN_JSONL_WORKERS": "0",
           "GRAPHRUN_ROW_WRITERS": "", "GRAPHRUN_ROW_POOL_BYTES": "1"}
    t = Tuning.from_machine(cores=16, environ=env)
    assert (t.parquet_threads, t.jsonl_workers, t.row_writers, t.row_pool_bytes) == (3, 0, 4, 1)
    assert Tuning.from_machine(cores=16, environ=env, parquet_threads=5).parquet_threads == 5
    assert Tuning.from_machine(cores=16, environ={"GRAPHRUN_TEXT_THREADS": "0"}
                               ).text_threads == 0


@pytest.mark.parametrize("value", ["many", "0", "-2", "1.5"])
def test_a_bad_value_names_the_variable_and_what_to_do(value):
    with pytest.raises(GraphrunError, match=re.escape(
            f"GRAPHRUN_PARQUET_THREADS={value!r} is not an integer of at least 1; set one or "
            "unset it")):
        Tuning.from_machine(cores=4, environ={"GRAPHRUN_PARQUET_THREADS": value})


def test_every_graphrun_variable_read_is_listed_in_envs():
    """A GRAPHRUN_* name anywhere in graphrun/ is one envs.VARIABLES lists, and each listed one
    is read somewhere."""
    named = set()
    for path in (ROOT / "graphrun").rglob("*.py"):
        if path.name != "envs.py":
            named |= set(re.findall(r"GRAPHRUN_[A-Z_]+", path.read_text()))
    assert named == set(envs.VARIABLES)
    with pytest.raises(KeyError, match="not listed"):
        envs.get("GRAPHRUN_NOT_A_THING")
