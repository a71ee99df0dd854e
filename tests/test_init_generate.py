"""`graphrun init --hf DIR --task generate`: a generation spec for a causal LM over a prompts
file; it validates, its seq buckets fit prompt and new tokens into the model's positions, and
a model that is no causal LM is one clear message."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import graphrun
from graphrun.cli.main import main

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or
    importlib.util.find_spec("tokenizers") is None,
    reason="needs transformers and tokenizers (pip install \"graphrun[hf]\")")

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "models" / "tiny-llama"  # 1024 positions, EOS 1


def cli(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def write_prompts(path: Path, n: int = 30, extra: dict | None = None) -> None:
    words = "the river city train report night garden letter music storm".split()
    rows = [{"id": f"q{i}", "prompt": " ".join(words[: 1 + i % 10]) * (1 + i % 4),
             **(extra or {})} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def init(tmp_path, folder, *extra, data=None):
    if data is None:
        data = tmp_path / "prompts.jsonl"
        write_prompts(data)
    spec_path = tmp_path / "specs" / "gen.yaml"
    result = cli("init", "--hf", folder, "--data", data, "-o", spec_path, "--task", "generate",
                 "--batch-size", 8, *extra)
    return result, spec_path


def test_the_written_spec_is_a_generation_job_that_validates(tmp_path):
    result, spec_path = init(tmp_path, TINY)
    assert result.exit_code == 0, result.output
    assert cli("validate", spec_path).exit_code == 0
    spec = graphrun.load_spec(spec_path)
    assert (spec.model.hf.class_, spec.model.dtype) == ("AutoModelForCausalLM", "float32")
    assert spec.inputs == {} and spec.outputs == {}
    assert spec.data.text.field == "prompt" and spec.data.id_field == "id"
    assert spec.data.group_by_length == 4096 and spec.data.batch_size == 8
    g = spec.generate
    assert (g.max_new_tokens, g.sampling.method, g.stop.eos) == (128, "greedy", "auto")
    assert spec.buckets["batch"] == [1, 2, 4, 8]
    seq = spec.buckets["seq"]
    assert all(v % 8 == 0 for v in seq) and seq[-1] + 128 <= 1024
    assert spec.output.format == "jsonl"
    text = spec_path.read_text()
    assert "inputs:" not in text and "outputs:" not in text
    assert "stopping at the model's EOS [1]" in result.output
    assert "generate: 128 new tokens at most, greedy" in result.output
    assert "call (" not in result.output


def test_seq_buckets_end_where_prompt_and_new_tokens_fill_the_positions(tmp_path):
    """A sample of the file: the last bucket is the positions less max_new_tokens."""
    folder = tmp_path / "short"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 200}))
    result, spec_path = init(tmp_path, folder, "--sample", 10)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(spec_path)
    assert spec.buckets["seq"][-1] == 72  # (200 - 128) rounded down to a multiple of 8
    assert spec.data.text.truncate is True


def test_too_few_positions_for_the_new_tokens_is_one_message(tmp_path):
    folder = tmp_path / "tiny"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 130}))
    result, _ = init(tmp_path, folder)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "the model holds 130 positions, too few for a prompt and 128 new tokens" in \
        result.output


def test_the_prompt_field_is_preferred_to_other_text(tmp_path):
    data = tmp_path / "two.jsonl"
    write_prompts(data, extra={"text": "a reference answer"})
    result, spec_path = init(tmp_path, TINY, data=data)
    assert result.exit_code == 0, result.output
    assert graphrun.load_spec(spec_path).data.text.field == "prompt"
    assert "string fields not used: text" in result.output


def test_a_model_that_is_no_causal_lm_is_refused(tmp_path):
    from tests.test_init_hf import save_model

    encoder = save_model(tmp_path / "bert", "embed")
    result, spec_path = init(tmp_path, encoder)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert ("--task generate: config.json names BertModel, which is no causal language model "
            "(a class ending in ForCausalLM or LMHeadModel)") in result.output
    assert not spec_path.exists()


def test_task_generate_needs_hf(tmp_path):
    write_prompts(tmp_path / "p.jsonl")
    result = cli("init", "--builtin", "mlp", "--data", tmp_path / "p.jsonl", "--task",
                 "generate", "-o", tmp_path / "x.yaml")
    assert result.exit_code != 0
    assert "--task generate needs --hf DIR" in result.output


def test_the_default_task_is_what_config_json_computes(tmp_path):
    """Without --task, a causal LM still gets the next token's top k (one pass per record)."""
    write_prompts(tmp_path / "p.jsonl")
    spec_path = tmp_path / "next.yaml"
    result = cli("init", "--hf", TINY, "--data", tmp_path / "p.jsonl", "-o", spec_path)
    assert result.exit_code == 0, result.output
    spec = graphrun.load_spec(spec_path)
    assert spec.generate is None and list(spec.outputs) == ["next_ids", "next_probs"]
