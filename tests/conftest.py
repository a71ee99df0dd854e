"""Shared test helpers: small specs written into tmp_path, and the cuda marker's skip."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

# One torch thread per test process (children inherit it): the tests' models are tiny, and
# the threads of several processes on a 2-core box spin waiting for each other.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402  (after OMP_NUM_THREADS, which torch reads as it loads)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    slow_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def slow_first(items) -> None:
    """Files by their number of slow tests, most first, the rest in their own order: with one
    process per core (scripts/test.sh, --no-loadscope-reorder) the long files start at once and
    the short ones fill the end, instead of one long file running alone after the others."""
    def file(item) -> str:
        return item.nodeid.split("::")[0]

    slow: dict[str, int] = {}
    for item in items:
        slow[file(item)] = slow.get(file(item), 0) + ("slow" in item.keywords)
    rank = {f: k for k, f in enumerate(sorted(slow, key=lambda f: -slow[f]))}
    items.sort(key=lambda item: rank[file(item)])


MLP_SPEC = """\
version: 1
name: tiny-mlp
device: cpu
model:
  builtin: mlp
  args: {in_features: 4, hidden: 8, layers: 2, out_features: 3}
inputs:
  x: {shape: [batch, 4], dtype: float32}
outputs:
  scores: {shape: [batch, 3]}
buckets:
  batch: [1, 2, 4]
capture:
  warmup_iters: 1
data:
  path: data.jsonl
  batch_size: 4
output:
  dir: out
"""


@pytest.fixture
def write_spec(tmp_path):
    """write_spec(text, data=None) -> path of a spec in tmp_path with a small data.jsonl."""

    def write(text: str = MLP_SPEC, *, name: str = "pipeline.yaml",
              data: str | None = None) -> Path:
        (tmp_path / "data.jsonl").write_text(
            data if data is not None else
            "".join(f'{{"x": [{i}, 1, 2, 3]}}\n' for i in range(10)))
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write
