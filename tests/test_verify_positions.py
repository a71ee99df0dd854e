"""Verification of padded positions (engine/verify.verify_positions): a record padded along a
bucket axis other than batch must give the outputs it gives unpadded. A model that reads the
padded positions (a mean over tokens without a mask, a mask input given a pad the model does not
mask) fails setup with the reason and remedies; a model that masks them passes, and the manifest
says it was checked. On the CPU with capture.verify.eager, which runs the same checks as a
GPU's setup less the capture."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from graphrun.cli.main import main

MODELS = """
import torch
from torch import nn


class MeanTokens(nn.Module):
    '''The mean over every position: a padded one counts.'''
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 4)

    def forward(self, tokens, mask):
        return {"pooled": self.emb(tokens).mean(1), "hidden": self.emb(tokens)}


class MaskedMean(MeanTokens):
    '''The mean over the positions the mask holds: padding (mask 0) does not count.'''
    def forward(self, tokens, mask):
        h = self.emb(tokens)
        m = mask[..., None].float()
        return {"pooled": (h * m).sum(1) / m.sum(1).clamp_min(1), "hidden": h}


def mean_tokens():
    return MeanTokens()


def masked_mean():
    return MaskedMean()
"""


def job(tmp_path, build: str, mask_pad: int = 0) -> dict:
    (tmp_path / "models.py").write_text(MODELS)
    lines = [{"id": "short", "tokens": [3, 4], "mask": [1, 1]},
             {"id": "long", "tokens": list(range(1, 9)), "mask": [1] * 8}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return {"version": 1, "name": "positions", "device": "cpu",
            "model": {"target": f"models.py:{build}"},
            "inputs": {"tokens": {"shape": ["batch", "seq"], "dtype": "int64", "range": [0, 50]},
                       "mask": {"shape": ["batch", "seq"], "dtype": "int64", "range": [0, 2],
                                "pad": mask_pad}},
            "outputs": {"pooled": {"shape": ["batch", 4]},
                        "hidden": {"shape": ["batch", "seq", 4]}},
            "buckets": {"batch": [1, 2], "seq": [2, 8]},
            "capture": {"verify": {"eager": True}, "lazy": False},
            "data": {"path": "data.jsonl", "id_field": "id", "batch_size": 2},
            "output": {"dir": "out", "format": "jsonl"}}


def run(tmp_path, spec: dict):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return CliRunner().invoke(main, ["run", str(path), "-q"])


@pytest.mark.parametrize("build, mask_pad", [("mean_tokens", 0), ("masked_mean", 1)])
def test_a_model_that_reads_padded_positions_fails_setup_naming_them(tmp_path, build,
                                                                      mask_pad):
    result = run(tmp_path, job(tmp_path, build, mask_pad))
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert ("verification failed: padded positions change real records' output(s) pooled: a "
            "record padded along seq gives other values than the same record unpadded") in said
    assert "mask the padded positions in the model" in said
    assert "capture.verify.positions: false" in said
    assert not list((tmp_path / "out").glob("part-*"))  # nothing wrong was written


def test_a_model_that_masks_padded_positions_passes_and_the_manifest_says_so(tmp_path):
    result = run(tmp_path, job(tmp_path, "masked_mean"))
    assert result.exit_code == 0, result.output
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    checks = {b["name"]: b["lanes"][0]["verify"]["pad_positions"] for b in m["buckets"]}
    # seq 1 or less has no position to pad; seq 8 and 2 were checked, at batch 1 and 2
    assert checks == {"batch=2,seq=8": True, "batch=2,seq=2": True, "batch=1,seq=8": True,
                      "batch=1,seq=2": True}
    rows = {r["id"]: r for r in map(json.loads, (tmp_path / "out" / "part-00000.jsonl")
                                    .read_text().splitlines())}
    assert len(rows["short"]["hidden"]) == 2 and len(rows["long"]["hidden"]) == 8


def test_the_check_can_be_turned_off_and_the_manifest_says_it_was_not_made(tmp_path):
    spec = job(tmp_path, "mean_tokens")
    spec["capture"]["verify"]["positions"] = False
    result = run(tmp_path, spec)
    assert result.exit_code == 0, result.output
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert {b["lanes"][0]["verify"]["pad_positions"] for b in m["buckets"]} == {None}
