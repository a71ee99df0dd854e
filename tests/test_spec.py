"""The spec: valid files load; broken ones give every error at its file:line:col."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from graphrun import SpecError, load_spec
from tests.conftest import MLP_SPEC
from tests.spec_text import edited, spec_error

replace = partial(edited, MLP_SPEC)


# (case id, spec text, overrides, expected "line:col" or None, expected message part)
BROKEN = [
    ("bad-yaml", replace("batch: [1, 2, 4]", "batch: [1, 2, 4"), [], None,
     "YAML syntax error"),
    ("tab-indent", replace("  builtin: mlp", "\tbuiltin: mlp"), [], "5:1", "never tabs"),
    ("duplicate-key", replace("name: tiny-mlp\n", "name: tiny-mlp\nname: again\n"), [], "3:1",
     "duplicate key (first defined at line 2)"),
    ("unknown-top-key", MLP_SPEC + "extra: 1\n", [], "20:1", "unknown key 'extra'"),
    ("unknown-key-depth-2", replace("warmup_iters: 1", "warmup_iter: 1"), [], "14:3",
     "did you mean 'warmup_iters'?"),
    ("unknown-key-depth-3", replace("dtype: float32}", "dtype: float32, rang: [0, 1]}"), [],
     "8:42", "unknown key 'rang'; did you mean 'range'?"),
    ("unknown-key-depth-4", replace("  warmup_iters: 1", "  verify: {enabled: true, tol: 1}"),
     [], "14:27", "capture.verify.tol: unknown key 'tol'"),
    ("wrong-type", replace("warmup_iters: 1", "warmup_iters: many"), [], "14:17",
     "must be a valid integer (got 'many')"),
    ("negative-warmup", replace("warmup_iters: 1", "warmup_iters: -2"), [], "14:17",
     "must be >= 0 (got -2)"),
    ("missing-model-source", replace("  builtin: mlp\n", ""), [], "5:3",
     "no model source: give exactly one of builtin, target, exported, torchscript"),
    ("two-model-sources", replace("  builtin: mlp\n", "  builtin: mlp\n  target: 'm:f'\n"), [],
     "6:11", "two model sources (builtin and target)"),
    ("unknown-builtin", replace("builtin: mlp", "builtin: transformer"), [], "5:12",
     "unknown builtin 'transformer'; the builtins are"),
    ("unknown-axis", replace("shape: [batch, 4], dtype", "shape: [batch, seq], dtype"), [],
     "8:22", "inputs.x.shape[1]: axis 'seq' has no bucket values"),
    ("unused-axis", replace("batch: [1, 2, 4]", "batch: [1, 2, 4]\n  seq: [8, 16]"), [],
     "13:8", "bucket axis 'seq' is used by no input shape"),
    ("batch-not-first", replace("shape: [batch, 4], dtype", "shape: [4, batch], dtype"), [],
     "8:15", "the first dimension must be 'batch'"),
    ("negative-bucket", replace("batch: [1, 2, 4]", "batch: [1, -4, 4]"), [], "12:14",
     "buckets.batch[1]: must be > 0 (got -4)"),
    ("bool-bucket", replace("batch: [1, 2, 4]", "batch: [true, 2, 4]"), [], "12:11",
     "buckets.batch[0]: must be a valid integer (got True)"),
    ("float-size", replace("shape: [batch, 4], dtype", "shape: [batch, 1e30], dtype"), [],
     "8:22", "inputs.x.shape[1]"),
    ("duplicate-bucket", replace("batch: [1, 2, 4]", "batch: [1, 2, 2]"), [], "12:10",
     "buckets.batch: duplicate bucket values [2]"),
    ("duplicate-bucket-second-axis",
     replace("shape: [batch, 4], dtype", "shape: [batch, seq], dtype")
     .replace("batch: [1, 2, 4]", "batch: [1, 2, 4]\n  seq: [4, 8, 8]"), [], "13:8",
     "buckets.seq: duplicate bucket values [8]"),
    ("duplicate-bucket-override", MLP_SPEC, ["buckets.batch=[4,4]"], None,
     "--set buckets.batch=[4,4]: buckets.batch: duplicate bucket values [4]"),
    ("bad-dtype", replace("dtype: float32", "dtype: float33"), [], "8:33",
     "inputs.x.dtype: must be 'float32'"),
    ("range-on-float", replace("dtype: float32}", "dtype: float32, range: [0, 1]}"), [],
     "8:49", "range applies to integer inputs only (dtype is float32)"),
    ("range-lo-not-below-hi", replace("dtype: float32}", "dtype: int64, range: [5, 5]}"), [],
     "8:47", "needs lo < hi (got [5, 5])"),
    ("finite-on-int", replace("dtype: float32}", "dtype: int64, finite: true}"), [], "8:48",
     "finite applies to float inputs only"),
    ("npy-ragged-output",
     replace("shape: [batch, 4], dtype", "shape: [batch, seq], dtype")
     .replace("shape: [batch, 3]", "shape: [batch, seq]")
     .replace("batch: [1, 2, 4]", "batch: [1, 2, 4]\n  seq: [4, 8]"), [], "10:19",
     "axis 'seq' varies per record, which npy files cannot hold: set output.format to jsonl "
     "or parquet"),
    ("missing-data-file", replace("path: data.jsonl", "path: nope.jsonl"), [], "16:9",
     "input file not found"),
    ("unknown-data-format", replace("path: data.jsonl", "path: data.csv"), [], "16:9",
     "unknown input format '.csv'"),
    ("missing-weights", replace("  builtin: mlp\n", "  builtin: mlp\n  weights: w.pt\n"), [],
     "6:12", "file not found"),
    ("batch-size-over-largest",
     replace("batch_size: 4", "batch_size: 64\n  oversize: error"), [], "17:15",
     "64 is larger than the largest batch bucket (4)"),
    ("decoder-oversize-eager",
     replace("builtin: mlp", "builtin: decoder").replace("batch_size: 4",
                                                        "batch_size: 64\n  oversize: eager"),
     [], "18:13", "the decoder's KV cache holds the largest batch bucket (4 rows)"),
    ("bad-device", replace("device: cpu", "device: gpu"), [], "3:9",
     "must be auto, cpu, cuda or cuda:N (got 'gpu')"),
    ("missing-required-key", replace("name: tiny-mlp\n", ""), [], "1:1",
     "required key 'name' is missing"),
    ("wrong-version", replace("version: 1", "version: 2"), [], "1:10", "must be 1 (got 2)"),
    ("missing-version", replace("version: 1\n", ""), [], "1:1",
     "version: required key 'version' is missing: add version: 1"),
    ("bad-override-value", MLP_SPEC, ["capture.warmup_iters=abc"], None,
     "--set capture.warmup_iters=abc: capture.warmup_iters: "),
    ("bad-override-syntax", MLP_SPEC, ["capture.warmup_iters"], None,
     "--set capture.warmup_iters: expected --set key.path=value"),
    ("override-into-scalar", MLP_SPEC, ["name.first=1"], None,
     "name is not a mapping"),
    ("bad-percentile", MLP_SPEC + "report: {percentiles: [50, 120]}\n", [], "20:23",
     "percentiles must lie in (0, 100] (got 120)"),
    ("not-a-mapping", "- just\n- a list\n", [], "1:1", "the spec must be a mapping"),
    # strict types: YAML's true, a quoted number, bytes and control characters are refused
    ("bool-rows-per-file", MLP_SPEC + "  rows_per_file: true\n", [], "20:18",
     "output.rows_per_file: must be a valid integer (got True)"),
    ("string-batch-size", replace("batch_size: 4", "batch_size: '4'"), [], "17:15",
     "data.batch_size: must be a valid integer (got '4')"),
    ("binary-name", replace("name: tiny-mlp", "name: !!binary dGlueQ=="), [], "2:7",
     "name: must be a valid string (got b'tiny')"),
    ("nul-in-name", replace("name: tiny-mlp", 'name: "tiny\\0mlp"'), [], "2:7",
     "name: holds the control character '\\x00' at 4"),
    ("huge-integer", replace("batch_size: 4", "batch_size: " + "9" * 5000), [], "17:15",
     "data.batch_size: an integer of 5000 digits, more than the 4300 Python reads"),
    ("huge-integer-override", MLP_SPEC, ["data.batch_size=" + "9" * 5000], None,
     "an integer of 5000 digits, more than the 4300 Python reads"),
]


@pytest.mark.parametrize("case,text,overrides,where,message", BROKEN,
                         ids=[c[0] for c in BROKEN])
def test_broken_spec_names_where_and_what(write_spec, case, text, overrides, where, message):
    path = write_spec(text)
    text = str(spec_error(path, overrides))
    assert message in text
    line = next(l for l in text.splitlines() if message.splitlines()[0][:30] in l)
    if where:
        assert line.startswith(f"{path}:{where}: "), line
    elif not overrides:
        assert line.startswith(f"{path}:"), line


def test_a_folder_where_a_file_belongs_is_named_a_folder_not_missing(write_spec, tmp_path):
    """data.path or model.weights naming a folder was 'input file not found' though it is
    there, which sent the user looking for a typo."""
    (tmp_path / "shards.jsonl").mkdir()
    (tmp_path / "w.pt").mkdir()
    path = write_spec(replace("path: data.jsonl", "path: shards.jsonl")
                      .replace("  builtin: mlp\n", "  builtin: mlp\n  weights: w.pt\n"))
    said = {p.path: p.message for p in spec_error(path).problems}
    assert said == {"data.path": f"{tmp_path / 'shards.jsonl'} is a folder, not a file: give "
                                 "the input file itself",
                    "model.weights": f"{tmp_path / 'w.pt'} is a folder, not a file: give the "
                                     "file itself"}


def test_all_errors_of_a_file_are_reported_at_once(write_spec):
    path = write_spec(replace("warmup_iters: 1", "warmup_iters: -1")
                      .replace("batch: [1, 2, 4]", "batch: [0, 2, 4]") + "extra: 1\n")
    problems = spec_error(path).problems
    assert len(problems) == 3
    assert [p.where for p in problems] == [f"{path}:12:11", f"{path}:14:17", f"{path}:20:1"]


def test_cross_field_errors_are_reported_together(write_spec):
    path = write_spec(replace("path: data.jsonl", "path: nope.jsonl")
                      .replace("builtin: mlp", "builtin: nothing"))
    assert len(spec_error(path).problems) == 2


def test_valid_spec_loads_with_defaults_sorted_buckets_and_resolved_paths(write_spec, tmp_path):
    path = write_spec(replace("batch: [1, 2, 4]", "batch: [4, 1, 2]"))
    spec = load_spec(path)
    assert spec.buckets["batch"] == [1, 2, 4]
    assert spec.data.path == tmp_path / "data.jsonl"
    assert spec.output.dir == tmp_path / "out"
    assert spec.capture.verify.rtol == 1e-3 and spec.capture.pool == "shared"
    assert spec.report.percentiles == [50, 90, 99]


def test_overrides_take_yaml_typed_values(write_spec):
    spec = load_spec(write_spec(), ["buckets.batch=[8,1,2]", "capture.warmup_iters=5",
                                    "capture.verify.enabled=false", "output.format=jsonl"])
    assert spec.buckets["batch"] == [1, 2, 8]
    assert spec.capture.warmup_iters == 5
    assert spec.capture.verify.enabled is False
    assert spec.output.format == "jsonl"


def test_overrides_of_the_wrong_type_are_one_clear_problem(write_spec):
    """One string was taken a character at a time (a problem per character, none saying
    why); a non-string item was an AttributeError; a path of None a TypeError from pathlib."""
    with pytest.raises(SpecError) as got:
        load_spec(write_spec(), "capture.warmup_iters=5")
    assert [(p.where, p.message) for p in got.value.problems] == [
        ("overrides", "expected a list of 'key.path=value' strings, got one string: pass "
                      "overrides=['capture.warmup_iters=5']")]
    with pytest.raises(SpecError, match=r"--set 5: expected a 'key.path=value' string"):
        load_spec(write_spec(), [5])
    with pytest.raises(SpecError, match=r"expected the spec file's path \(a str or Path\), "
                                        "got NoneType"):
        load_spec(None)


def test_paths_resolve_against_the_spec_folder_not_the_cwd(write_spec, tmp_path, monkeypatch):
    path = write_spec()
    monkeypatch.chdir("/")
    assert load_spec(path).data.path == tmp_path / "data.jsonl"


def test_missing_spec_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="cannot read the spec"):
        load_spec(tmp_path / "nope.yaml")


def test_a_model_folder_s_vocabulary_from_its_config_or_text_config(tmp_path):
    # one reader for the spec's stop-id check and the text reader's token-id check
    import json

    from graphrun.spec.paths import model_vocab

    for name, config, want in [("a", {"vocab_size": 50}, 50),
                               ("b", {"vocab_size": None, "text_config": {"vocab_size": 70}}, 70),
                               ("c", {"vocab_size": True}, None), ("d", [1], None)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        assert model_vocab(tmp_path / name) == want, name
    assert model_vocab(tmp_path / "missing") is None


def test_a_bucket_axis_given_text_asks_for_a_list():
    with pytest.raises(SpecError) as err:
        load_spec(Path(__file__).parents[1] / "pipelines" / "mlp-scorer.yaml",
                  ["buckets.batch=1,8"])
    assert ("buckets.batch: must be a list of sizes such as [1, 8, 32], or 'auto' (got '1,8')"
            in str(err.value))
