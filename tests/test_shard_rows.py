"""output.rows_per_file's default: shards of about 64 MiB of outputs, from the spec alone, so
that full shards commit while the stream goes on and a crash costs at most one shard's work."""

from __future__ import annotations

import numpy as np

import graphrun
from graphrun.spec import keys
from tests.spec_text import edited, mlp_spec


def spec_with(tmp_path, outputs: str, rows: str = "") -> keys.PipelineSpec:
    text = mlp_spec("shards", path="x.npy", batch_size=4)
    text = edited(text, "  scores: {shape: [batch, 2]}", outputs)
    if rows:
        text = edited(text, "output: {dir: out}", f"output: {{dir: out, rows_per_file: {rows}}}")
    if not (tmp_path / "x.npy").exists():
        np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal(
            (5000, 2), dtype=np.float32))
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return graphrun.load_spec(path)


def test_the_default_makes_shards_of_about_64_mib(tmp_path):
    embedding = spec_with(tmp_path, "  scores: {shape: [batch, 384], dtype: float32}")
    assert embedding.output.rows_per_file == 43008  # 43008 x 1536 bytes: 63 MiB
    wide = spec_with(tmp_path, "  scores: {shape: [batch, 32000], dtype: float32}")
    assert wide.output.rows_per_file == 1024  # the least: 125 MiB
    small = spec_with(tmp_path, "  scores: {shape: [batch, 2], dtype: float32}")
    assert small.output.rows_per_file == 100000  # the most
    given = spec_with(tmp_path, "  scores: {shape: [batch, 384], dtype: float32}", rows="7")
    assert given.output.rows_per_file == 7
    # the resolved spec (run.json's, --resume's) says the number: loading it again keeps it
    again = keys.PipelineSpec.model_validate(embedding.model_dump(mode="json"))
    assert again.output.rows_per_file == 43008


def test_a_run_writes_shards_of_the_default_size(tmp_path, monkeypatch):
    # a patch: the default is computed while the spec loads (a validator), with no caller
    monkeypatch.setattr(keys, "SHARD_BYTES", 1024 * 2 * 4 * 2)  # two shards of 1024 rows' worth
    spec = spec_with(tmp_path, "  scores: {shape: [batch, 2], dtype: float32}")
    assert spec.output.rows_per_file == 2048
    manifest = graphrun.run(spec, out=tmp_path / "out")
    shards = sorted((tmp_path / "out").glob("part-*.scores.npy"))
    assert [len(np.load(p)) for p in shards] == [2048, 2048, 904]
    assert manifest.totals.records_out == 5000
    assert manifest.spec["output"]["rows_per_file"] == 2048  # the resolved spec says it
