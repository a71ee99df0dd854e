"""`graphrun init`: specs written from a model and a data file validate, and run to the outputs
of calling the model eagerly on each record."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main

DENSE = """
import torch
from torch import nn

class Scorer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, 3)

    def forward(self, x):
        return torch.tanh(self.lin(x))

def build(d=6):
    torch.manual_seed(0)
    return Scorer(d)
"""

# two inputs of one varying length; a dict of a per-position and a pooled output
ENCODER = """
import torch
from torch import nn

class Encoder(nn.Module):
    def __init__(self, vocab, d):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lin = nn.Linear(d, d)

    def forward(self, tokens, mask):
        keep = (mask != 0).unsqueeze(-1).float()            # [B, S, 1]
        hidden = torch.relu(self.lin(self.emb(tokens))) * keep  # [B, S, d]
        pooled = hidden.sum(1) / keep.sum(1).clamp(min=1)       # [B, d]
        return {"hidden": hidden, "pooled": pooled}

def build(vocab=50, d=4):
    torch.manual_seed(0)
    return Encoder(vocab, d)
"""

# a tuple return; the Parquet file also holds an id column and a column the model does not take
TWO_HEADS = """
import torch
from torch import nn

class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(5, 2)
        self.b = nn.Linear(5, 4)

    def forward(self, features):
        return self.a(features), torch.softmax(self.b(features), -1)

def build():
    return TwoHeads()
"""


def cli(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def model_from(tmp_path, source: str, **args):
    path = tmp_path / "net.py"
    path.write_text(textwrap.dedent(source))
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    model = namespace["build"](**args).eval()
    return f"{path}:build", model


def init_and_run(tmp_path, target, data, *extra):
    spec_path = tmp_path / "specs" / "pipe.yaml"
    result = cli("init", "--model", target, "--data", data, "-o", spec_path,
                 "--out-dir", tmp_path / "out", "--batch-size", 8, *extra)
    assert result.exit_code == 0, result.output
    assert cli("validate", spec_path).exit_code == 0
    assert spec_path.read_text().splitlines()[0] == \
        "# yaml-language-server: $schema=pipeline.schema.json"
    schema = json.loads((spec_path.parent / "pipeline.schema.json").read_text())
    assert schema["title"] == "graphrun pipeline spec, version 1"
    spec = graphrun.load_spec(spec_path)
    manifest = graphrun.run(spec)
    assert manifest.status == "completed"
    return spec, result.output


def eager(model, **inputs):
    with torch.no_grad():
        return model(**{k: torch.as_tensor(v)[None] for k, v in inputs.items()})


def test_dense_npy_with_an_unnamed_array_takes_the_forward_argument_name(tmp_path):
    target, model = model_from(tmp_path, DENSE)
    rows = np.random.default_rng(0).standard_normal((21, 6)).astype(np.float32)
    np.save(tmp_path / "rows.npy", rows)
    spec, printed = init_and_run(tmp_path, target, tmp_path / "rows.npy")
    assert list(spec.inputs) == ["x"] and spec.inputs["x"].shape == ["batch", 6]
    assert spec.outputs["output"].shape == ["batch", 3]
    assert spec.buckets == {"batch": [1, 2, 4, 8]} and spec.output.format == "npy"
    assert spec.model.call == "keyword" and spec.data.id_field is None
    assert "input  x: [batch, 6] float32" in printed and "check:" in printed
    got = np.load(tmp_path / "out" / "part-00000.output.npy")
    want = np.stack([eager(model, x=r)[0].numpy() for r in rows])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert (np.load(tmp_path / "out" / "part-00000.ids.npy") == np.arange(21)).all()


def test_variable_length_jsonl_with_two_inputs_shares_one_axis_and_cuts_outputs(tmp_path):
    target, model = model_from(tmp_path, ENCODER, vocab=50, d=4)
    rng = np.random.default_rng(1)
    records = []
    for i in range(19):
        n = int(rng.integers(2, 13))
        records.append({"id": f"r{i}", "tokens": rng.integers(0, 50, n).tolist(),
                        "mask": [1] * n})
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    spec, printed = init_and_run(tmp_path, target, tmp_path / "texts.jsonl",
                                 "--arg", "vocab=50")
    assert spec.model.args == {"vocab": 50}
    assert spec.inputs["tokens"].shape == ["batch", "seq"] == spec.inputs["mask"].shape
    assert spec.inputs["tokens"].dtype == "int64"
    assert spec.inputs["tokens"].range == (0, 50)  # the model's embedding, not the sample's max
    assert spec.inputs["mask"].range == (0, 2)  # no embedding near it: the sample's values
    assert spec.outputs["hidden"].shape == ["batch", "seq", 4]
    assert spec.outputs["pooled"].shape == ["batch", 4]
    lengths = [len(r["tokens"]) for r in records]
    assert (min(lengths), max(lengths)) == (3, 12)
    assert spec.buckets == {"batch": [1, 2, 4, 8], "seq": [4, 8, 16]}  # powers of two
    assert spec.data.id_field == "id" and spec.output.format == "jsonl"
    assert "inputs.tokens.range" in printed and "buckets.seq" in printed
    lines = [json.loads(l) for l in (tmp_path / "out" / "part-00000.jsonl").open()]
    assert [l["id"] for l in lines] == [r["id"] for r in records]
    for line, r in zip(lines, records):
        want = eager(model, tokens=r["tokens"], mask=r["mask"])
        np.testing.assert_allclose(line["hidden"], want["hidden"][0].numpy(), rtol=1e-4,
                                   atol=1e-5)
        np.testing.assert_allclose(line["pooled"], want["pooled"][0].numpy(), rtol=1e-4,
                                   atol=1e-5)


def test_parquet_with_an_id_column_and_a_tuple_return(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    target, model = model_from(tmp_path, TWO_HEADS)
    rng = np.random.default_rng(2)
    feats = rng.standard_normal((13, 5)).astype(np.float32)
    ids = [f"req-{i:03d}" for i in range(13)]
    history = [list(range(i % 5 + 1)) for i in range(13)]  # varies; the model does not take it
    pq.write_table(pa.table({"request_id": ids, "features": feats.tolist(),
                             "label": rng.integers(0, 2, 13), "history": history}),
                   tmp_path / "rows.parquet")
    spec, printed = init_and_run(tmp_path, target, tmp_path / "rows.parquet")
    assert spec.data.id_field == "request_id" and list(spec.inputs) == ["features"]
    assert {n: o.shape for n, o in spec.outputs.items()} == {
        "output0": ["batch", 2], "output1": ["batch", 4]}
    assert spec.output.format == "parquet" and "not used as inputs: label, history" in printed
    assert spec.buckets == {"batch": [1, 2, 4, 8]}  # no axis for the column left out
    table = pq.read_table(tmp_path / "out" / "part-00000.parquet").to_pydict()
    assert table["id"] == ids
    for i, row in enumerate(feats):
        a, b = eager(model, features=row)
        np.testing.assert_allclose(table["output0"][i], a[0].numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(table["output1"][i], b[0].numpy(), rtol=1e-4, atol=1e-5)


def test_a_model_that_fails_on_the_data_gets_runs_message_and_no_spec(tmp_path):
    target, _ = model_from(tmp_path, DENSE, d=6)
    np.save(tmp_path / "rows.npy", np.zeros((4, 7), np.float32))  # 7 features, model takes 6
    result = cli("init", "--model", target, "--data", tmp_path / "rows.npy", "-o",
                 tmp_path / "p.yaml")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "error: the model failed on its first call, model(x=[2, 7] float32)" in result.output
    assert "--debug shows the traceback" in result.output
    assert not (tmp_path / "p.yaml").exists()


def test_a_model_returning_one_number_for_the_batch_is_a_clear_error(tmp_path):
    """A 0-d output (x.sum()): init names the output and the fix, writes no spec and no
    schema, instead of an internal error about the spec it would have written."""
    target, _ = model_from(tmp_path, """
        import torch
        from torch import nn
        class Total(nn.Module):
            def forward(self, x):
                return x.sum()
        def build():
            return Total()
        """)
    np.save(tmp_path / "rows.npy", np.ones((4, 3), np.float32))
    result = cli("init", "--model", target, "--data", tmp_path / "rows.npy", "-o",
                 tmp_path / "p.yaml")
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output and "report" not in said
    assert "error: output 'output' is one number (a 0-d tensor) for a batch of 2 records" in said
    assert "reduce over the other dimensions only (x.sum(dim=1))" in said
    assert not (tmp_path / "p.yaml").exists()
    assert not (tmp_path / "pipeline.schema.json").exists()


def test_a_model_that_cannot_be_built_and_an_existing_spec_are_clear_errors(tmp_path):
    np.save(tmp_path / "rows.npy", np.zeros((4, 6), np.float32))
    result = cli("init", "--model", f"{tmp_path}/missing.py:build", "--data",
                 tmp_path / "rows.npy", "-o", tmp_path / "p.yaml")
    assert result.exit_code == 2
    assert f"model.target '{tmp_path}/missing.py:build': file not found" in result.output
    (tmp_path / "p.yaml").write_text("mine\n")
    target, _ = model_from(tmp_path, DENSE)
    again = cli("init", "--model", target, "--data", tmp_path / "rows.npy", "-o",
                tmp_path / "p.yaml")
    assert again.exit_code == 2 and "--force" in again.output
    assert (tmp_path / "p.yaml").read_text() == "mine\n"


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_a_spec_named_as_the_schema_is_refused(tmp_path, force):
    """-o pipeline.schema.json wrote the schema, then the spec over it: 'wrote ... (and
    pipeline.schema.json beside it)', and the spec's $schema line named the spec itself."""
    np.save(tmp_path / "rows.npy", np.zeros((4, 6), np.float32))
    target, _ = model_from(tmp_path, DENSE)
    result = cli("init", "--model", target, "--data", tmp_path / "rows.npy", "-o",
                 tmp_path / "pipeline.schema.json", *force)
    assert result.exit_code == 2, result.output
    assert ("-o pipeline.schema.json: that name is the schema's, which init writes beside the "
            "spec: name the spec another file, e.g. -o pipeline.yaml") in result.output
    assert not (tmp_path / "pipeline.schema.json").exists()


def test_a_jsonl_field_the_model_does_not_take_is_named(tmp_path):
    target, _ = model_from(tmp_path, DENSE)
    (tmp_path / "d.jsonl").write_text('{"x": [1, 2, 3, 4, 5, 6], "label": 1}\n')
    result = cli("init", "--model", target, "--data", tmp_path / "d.jsonl", "-o",
                 tmp_path / "p.yaml")
    assert result.exit_code == 2
    assert "field 'label' is not an argument of the model's forward (x)" in result.output


def test_builtin_mlp_with_builder_args(tmp_path):
    np.save(tmp_path / "x.npy", np.ones((5, 4), np.float32))
    result = cli("init", "--builtin", "mlp", "--arg", "in_features=4", "--arg", "hidden=8",
                 "--arg", "out_features=2", "--data", tmp_path / "x.npy", "-o",
                 tmp_path / "p.yaml", "--batch-size", 4)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(tmp_path / "p.yaml")
    assert spec.model.builtin == "mlp" and spec.outputs["output"].shape == ["batch", 2]
    assert spec.buckets["batch"] == [1, 2, 4]


def test_bad_records_are_left_out_of_the_sample_and_whole_numbers_can_be_floats(tmp_path):
    target, _ = model_from(tmp_path, DENSE)
    good = [json.dumps({"x": [i, 1, 2, 3, 4, 5]}) for i in range(6)]
    (tmp_path / "d.jsonl").write_text("\n".join(good[:3] + ['{"x": [1, 2', '{"y": 1}']
                                                + good[3:]) + "\n")
    result = cli("init", "--model", target, "--data", tmp_path / "d.jsonl", "-o",
                 tmp_path / "p.yaml")
    assert result.exit_code == 0, result.output
    assert "read 6 records of d.jsonl (of 8)" in result.output
    assert "2 records of the sample could not be used and were left out" in result.output
    # each named, with the reason `run` gives: a line cut short, other fields
    said = " ".join(result.output.split())
    assert "d.jsonl:4: invalid JSON: Expecting ',' delimiter (column 12)" in said
    assert "d.jsonl:5: fields ['y'] differ from the first record's ['x']" in said
    x = graphrun.load_spec(tmp_path / "p.yaml").inputs["x"]
    assert x.shape == ["batch", 6] and x.dtype == "float32" and x.range is None
    assert "inputs x: whole numbers only in the file, which the model took as float32" in said


def test_an_npy_file_of_whole_numbers_names_the_input_and_the_array(tmp_path):
    target, _ = model_from(tmp_path, DENSE)
    np.save(tmp_path / "counts.npy", np.random.default_rng(0).integers(0, 5, (20, 6)))
    result = cli("init", "--model", target, "--data", tmp_path / "counts.npy", "-o",
                 tmp_path / "p.yaml")
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "inputs x (the file's counts): whole numbers only in the file" in said


def test_a_module_target_beside_the_working_directory_is_flagged(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(textwrap.dedent(DENSE))
    np.save(tmp_path / "x.npy", np.ones((3, 6), np.float32))
    monkeypatch.chdir(tmp_path)
    here = cli("init", "--model", "mymodels:build", "--data", "x.npy")
    assert here.exit_code == 0, here.output
    assert graphrun.load_spec(tmp_path / "pipeline.yaml").model.target == "mymodels:build"
    assert "imported from" not in here.output  # the spec sits beside the module
    away = cli("init", "--model", "mymodels:build", "--data", "x.npy", "-o", "specs/p.yaml")
    assert away.exit_code == 0, away.output
    assert f"mymodels was imported from {tmp_path.resolve()}, but `run` imports beside the " \
        f"spec ({tmp_path.resolve() / 'specs'})" in " ".join(away.output.split())


# a convolution over fixed [3, 8, 8] images
CNN = """
import torch
from torch import nn

class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.conv = nn.Conv2d(3, 2, 3)

    def forward(self, image):
        return self.conv(image).mean((2, 3))  # [B, 2]

def build():
    return Cnn()
"""


def test_init_infers_from_the_majority_and_lists_the_records_that_disagree(tmp_path):
    target, model = model_from(tmp_path, ENCODER)
    rng = np.random.default_rng(3)
    records = []
    for i in range(30):
        n = int(rng.integers(3, 12))
        records.append({"id": f"r{i}", "tokens": rng.integers(0, 40, n).tolist(),
                        "mask": [1] * n})
    bad = [{"id": "b1", "tokens": [1, 1.5, 2], "mask": [1, 1, 1]},  # not a whole number
           {"id": "b2", "tokens": [], "mask": []},  # empty
           {"id": "b3", "tokens": [3, 70, 4], "mask": [1, 1, 1]},  # over the 50-row table
           {"id": "b4", "tokens": [-1, 4, 5], "mask": [1, 1, 1]},  # negative
           {"id": "b5", "tokens": [5, 6, 7, 8], "mask": [1, 1, 1]}]  # mask one shorter
    lines = [json.dumps(r) for r in records[:5] + bad + records[5:]]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    spec_path = tmp_path / "specs" / "pipe.yaml"
    result = cli("init", "--model", target, "--data", tmp_path / "d.jsonl", "-o", spec_path,
                 "--out-dir", tmp_path / "out", "--batch-size", 8)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(spec_path)
    tokens = spec.inputs["tokens"]
    assert tokens.dtype == "int64" and tokens.range == (0, 50)  # the model's table, not 71
    assert tokens.shape == ["batch", "seq"] == spec.inputs["mask"].shape  # one axis, no seq2
    assert set(spec.buckets) == {"batch", "seq"}
    printed = " ".join(result.output.split())
    for line, why in [(6, "tokens holds 1.5, not a whole number"), (7, "tokens is empty"),
                      (8, "tokens holds 70, outside [0, 50)"),
                      (9, "tokens holds -1, outside [0, 50)"),
                      (10, "mask has 3 positions where tokens has 4")]:
        assert f"d.jsonl:{line}: {why}" in printed, (line, printed)
    # the records outside the model's table come under their own line, not counted among the
    # ones that disagree with the sample
    head = "records holding what the model's tables cannot take"
    assert printed.index("disagree") < printed.index(head) < printed.index(
        "d.jsonl:8: tokens holds 70")
    spec.data.on_bad_record = "skip"
    manifest = graphrun.run(spec)
    assert manifest.status == "completed"
    assert manifest.totals.records_in == 35 and manifest.totals.records_rejected == 5


def test_init_leaves_out_a_record_holding_a_string_where_the_rest_hold_numbers(tmp_path):
    target, _ = model_from(tmp_path, ENCODER)
    rows = [{"id": f"r{i}", "tokens": list(range(1, 4 + i % 5)), "mask": [1] * (3 + i % 5)}
            for i in range(20)]
    rows[6] = {"id": "s", "tokens": "abc", "mask": [1, 1, 1]}
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = cli("init", "--model", target, "--data", tmp_path / "d.jsonl", "-o",
                 tmp_path / "p.yaml", "--out-dir", tmp_path / "out", "--batch-size", 4)
    assert result.exit_code == 0, result.output
    assert "d.jsonl:7: tokens holds a string where 19 of 20 records hold numbers" in " ".join(
        result.output.split())
    spec = graphrun.load_spec(tmp_path / "p.yaml")
    assert spec.inputs["tokens"].dtype == "int64" and spec.data.id_field == "id"


def test_init_keeps_an_image_size_the_majority_holds(tmp_path):
    target, _ = model_from(tmp_path, CNN)
    rng = np.random.default_rng(4)
    rows = [{"image": rng.normal(size=(3, 8, 8)).round(3).tolist()} for _ in range(12)]
    rows[3] = {"image": rng.normal(size=(1, 8, 8)).round(3).tolist()}  # one channel
    rows[7] = {"image": rng.normal(size=(3, 8, 7)).round(3).tolist()}  # one column short
    (tmp_path / "img.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = cli("init", "--model", target, "--data", tmp_path / "img.jsonl", "-o",
                 tmp_path / "p.yaml", "--out-dir", tmp_path / "out", "--batch-size", 4)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(tmp_path / "p.yaml")
    assert spec.inputs["image"].shape == ["batch", 3, 8, 8]
    assert set(spec.buckets) == {"batch"}
    printed = " ".join(result.output.split())
    assert "img.jsonl:4: image has 1 at dimension 1 where 11 of 12 records have 3" in printed
    assert "img.jsonl:8: image has 7 at dimension 3 where" in printed


# token and position embeddings: at most 16 positions
POSITIONS = """
import torch
from torch import nn

class Positional(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.tok = nn.Embedding(50, 4)
        self.pos = nn.Embedding(16, 4)

    def forward(self, tokens):
        at = torch.arange(tokens.shape[1])  # [S]; past 16 an IndexError
        return (self.tok(tokens) + self.pos(at)).sum(1)  # [B, 4]

def build():
    return Positional()
"""


def test_init_stops_an_axis_at_the_models_position_table(tmp_path):
    target, _ = model_from(tmp_path, POSITIONS)
    rng = np.random.default_rng(6)
    records = [{"tokens": rng.integers(0, 45, int(rng.integers(3, 14))).tolist()}
               for _ in range(20)]
    records[4] = {"tokens": rng.integers(0, 45, 40).tolist()}  # past the 16 positions
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    result = cli("init", "--model", target, "--data", tmp_path / "d.jsonl", "-o",
                 tmp_path / "p.yaml", "--out-dir", tmp_path / "out", "--batch-size", 4)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(tmp_path / "p.yaml")
    assert spec.buckets["seq"][-1] == 16 and spec.inputs["tokens"].range == (0, 50)
    assert "d.jsonl:5: 40 positions along seq, past the model's nn.Embedding of 16 rows" \
        in " ".join(result.output.split())
    spec.data.on_bad_record = "skip"
    manifest = graphrun.run(spec)
    assert (manifest.totals.records_out, manifest.totals.records_rejected) == (19, 1)


def test_two_specs_of_one_model_get_their_own_output_folders(tmp_path):
    """Without --out-dir, output.dir is runs/<the spec file's stem>: a second spec of the same
    model (another batch size, say) runs beside the first instead of finding its folder taken."""
    target, _ = model_from(tmp_path, DENSE)
    np.save(tmp_path / "rows.npy", np.ones((5, 6), np.float32))
    folders = []
    for spec_name, batch in (("small.yaml", 2), ("big batch.yaml", 8)):
        spec_path = tmp_path / spec_name
        result = cli("init", "--model", target, "--data", tmp_path / "rows.npy", "-o",
                     spec_path, "--batch-size", batch)
        assert result.exit_code == 0, result.output
        spec = graphrun.load_spec(spec_path)
        assert graphrun.run(spec).status == "completed"
        folders.append(spec.output.dir)
    assert folders == [tmp_path / "runs" / "small", tmp_path / "runs" / "big-batch"]
    assert all((f / "manifest.json").is_file() for f in folders)
