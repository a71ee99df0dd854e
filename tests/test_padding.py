"""padding.py: padding counted in rows and in positions per bucket axis."""

from __future__ import annotations

import json
from pathlib import Path

import graphrun

PIPELINES = Path(__file__).resolve().parent.parent / "pipelines"


def test_padding_is_counted_in_rows_and_in_positions_per_axis(tmp_path):
    """Records of seq lengths 3 and 5 in one batch of bucket batch=4, seq=8: 2 padded rows;
    positions 4 x 8 = 32, real 8, padded 24."""
    (tmp_path / "d.jsonl").write_text(
        json.dumps({"tokens": [1, 2, 3], "mask": [1, 1, 1]}) + "\n"
        + json.dumps({"tokens": [1, 2, 3, 4, 5], "mask": [1] * 5}) + "\n")
    spec = graphrun.load_spec(PIPELINES / "encoder.yaml", [
        f"data.path={tmp_path / 'd.jsonl'}", "data.id_field=null", "buckets.batch=[4]",
        "buckets.seq=[8]", "device=cpu", "model.args.max_len=8"])
    m = graphrun.run(spec, out=tmp_path / "out")
    (b,) = [b for b in m.buckets if b.batches]
    assert (b.records, b.padded_rows, b.padded_positions) == (2, 2, {"seq": 24})
    assert m.totals.padding_ratio == 0.5 and m.totals.padding_ratio_positions == {"seq": 0.75}
    on_disk = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert on_disk["totals"]["padding_ratio_positions"] == {"seq": 0.75}

