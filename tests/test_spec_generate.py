"""The generate: section: a generation spec loads; each rule's message at its file:line:col."""

from __future__ import annotations

from functools import partial

import pytest

from graphrun import load_spec
from tests.conftest import MLP_SPEC
from tests.spec_text import edited, problems

GEN_SPEC = """\
version: 1
name: gen
device: cpu
model:
  hf: {path: model, class: AutoModelForCausalLM}
data:
  path: prompts.jsonl
  id_field: id
  text: {field: prompt}
  batch_size: 4
generate:
  max_new_tokens: 16
  sampling: {method: greedy}
  stop: {eos: auto}
buckets:
  batch: [1, 4]
  seq: [16, 32]
output: {dir: out, format: jsonl}
"""


@pytest.fixture
def write_gen(tmp_path):
    """write_gen(text) -> a spec in tmp_path beside a prompts file and a model folder."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    (tmp_path / "prompts.jsonl").write_text(
        "".join(f'{{"id": {i}, "prompt": "a prompt {i}"}}\n' for i in range(5)))

    def write(text: str = GEN_SPEC):
        path = tmp_path / "gen.yaml"
        path.write_text(text)
        return path

    return write


edit = partial(edited, GEN_SPEC)


def test_a_generation_spec_loads_with_its_defaults(write_gen):
    spec = load_spec(write_gen())
    g = spec.generate
    assert (g.max_new_tokens, g.min_new_tokens) == (16, 0)
    assert g.sampling.method == "greedy" and g.stop.eos == "auto" and g.stop.token_ids == []
    assert spec.inputs == {} and spec.outputs == {}
    assert spec.data.text.field == "prompt"
    assert (g.slots, g.kv_block_size, g.kv_blocks, g.prefill_tokens) == (None, 16, None, None)
    assert load_spec(write_gen(), ["generate.slots=auto"]).generate.slots == "auto"


def test_sampling_keys_load_with_method_sample(write_gen):
    spec = load_spec(write_gen(edit(
        "sampling: {method: greedy}",
        "sampling: {method: sample, temperature: 0.8, top_k: 50, top_p: 0.95, seed: 7}")))
    s = spec.generate.sampling
    assert (s.method, s.temperature, s.top_k, s.top_p, s.seed) == ("sample", 0.8, 50, 0.95, 7)
    spec = load_spec(write_gen(edit("stop: {eos: auto}", "stop: {eos: none, token_ids: [3]}")))
    assert (spec.generate.stop.eos, spec.generate.stop.token_ids) == ("none", [3])


def test_penalties_and_logprobs_load_beside_greedy(write_gen):
    spec = load_spec(write_gen(edit(
        "sampling: {method: greedy}",
        "sampling: {method: greedy, repetition_penalty: 1.2, presence_penalty: -0.5, "
        "frequency_penalty: 0.3}\n  logprobs: 5")))
    g = spec.generate
    assert (g.sampling.repetition_penalty, g.sampling.presence_penalty,
            g.sampling.frequency_penalty, g.logprobs) == (1.2, -0.5, 0.3, 5)
    assert load_spec(write_gen(edit("{method: greedy}", "{method: sample, min_p: 0.05}"))
                     ).generate.sampling.min_p == 0.05


def test_a_generation_spec_dumped_and_loaded_again_is_valid(write_gen):
    """A resolved spec (the manifest's, a worker's) holds inputs: {} and outputs: {}."""
    import yaml

    spec = load_spec(write_gen())
    path = write_gen(yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True)))
    assert load_spec(path).generate.max_new_tokens == 16


# (case, spec text, --set overrides, "line:col" or None, message part)
BROKEN = [
    ("inputs-given",
     GEN_SPEC + "inputs:\n  input_ids: {shape: [batch, seq], dtype: int64}\n", [], "20:3",
     "inputs: with generate: the inputs are implied (the tokenizer's input_ids and "
     "attention_mask in, the completion out): remove inputs:"),
    ("outputs-given", GEN_SPEC + "outputs:\n  logits: {shape: [batch, seq, 10]}\n", [], "20:3",
     "outputs: with generate: the outputs are implied"),
    ("no-text", edit("  text: {field: prompt}\n", ""), [], "7:3",
     "data: with generate: the prompts are text, tokenized by the model's tokenizer: add "
     "data.text: {field: prompt}"),
    ("not-causal", edit("class: AutoModelForCausalLM", "class: AutoModel"), [], "5:28",
     "model.hf.class: AutoModel is no causal LM, and generate: needs one: use "
     "AutoModelForCausalLM"),
    ("builtin-decoder", edit("  hf: {path: model, class: AutoModelForCausalLM}\n",
                             "  builtin: decoder\n"), [], "5:12",
     "model.builtin: generate: needs a causal LM: model.hf (class AutoModelForCausalLM or "
     "another causal-LM class) or builtin llama"),
    ("third-axis", edit("  seq: [16, 32]\n", "  seq: [16, 32]\n  kv: [64]\n"), [], "18:7",
     "buckets.kv: a generation job has the bucket axes batch (decode rows) and seq (prompt "
     "lengths) only: remove kv"),
    ("no-seq", edit("  seq: [16, 32]\n", ""), [], "16:3",
     "buckets: a generation job needs buckets.seq"),
    ("min-over-max", edit("max_new_tokens: 16", "max_new_tokens: 16\n  min_new_tokens: 17"),
     [], "13:19", "generate.min_new_tokens: 17 is more than max_new_tokens (16)"),
    ("max-zero", edit("max_new_tokens: 16", "max_new_tokens: 0"), [], "12:19",
     "generate.max_new_tokens: must be > 0 (got 0)"),
    ("min-negative", edit("max_new_tokens: 16", "max_new_tokens: 16\n  min_new_tokens: -1"),
     [], "13:19", "generate.min_new_tokens: must be >= 0 (got -1)"),
    ("greedy-temperature", edit("{method: greedy}", "{method: greedy, temperature: 0.7}"), [],
     "13:13", "generate.sampling: temperature 0.7 given with method greedy, which always takes "
     "the most likely token: set method: sample to sample with them, or remove them"),
    ("default-greedy-top-k", edit("{method: greedy}", "{top_k: 5, seed: 1}"), [], "13:13",
     "top_k 5, seed 1 given with method greedy"),
    ("negative-temperature", edit("{method: greedy}", "{method: sample, temperature: -1}"), [],
     "13:43", "generate.sampling.temperature: must be >= 0 (got -1)"),
    ("greedy-huge-seed", edit("{method: greedy}", "{seed: 1180591620717411303424}"), [],
     "13:13", "seed 1180591620717411303424 given with method greedy"),  # 2**70, exactly
    ("top-p-over-one", edit("{method: greedy}", "{method: sample, top_p: 1.5}"), [], "13:37",
     "generate.sampling.top_p: must be <= 1 (got 1.5)"),
    ("top-p-zero", edit("{method: greedy}", "{method: sample, top_p: 0}"), [], "13:37",
     "generate.sampling.top_p: must be > 0 (got 0)"),
    ("negative-top-k", edit("{method: greedy}", "{method: sample, top_k: -1}"), [], "13:37",
     "generate.sampling.top_k: must be >= 0 (got -1)"),
    ("unknown-method", edit("{method: greedy}", "{method: beam}"), [], "13:22",
     "generate.sampling.method: must be 'greedy' or 'sample' (got 'beam')"),
    ("typo-in-sampling", edit("{method: greedy}", "{method: sample, temprature: 0.5}"), [],
     "13:30", "unknown key 'temprature'; did you mean 'temperature'?"),
    ("prefill-under-longest",
     edit("max_new_tokens: 16", "max_new_tokens: 16\n  prefill_tokens: 20"), [], "13:19", "generate.prefill_tokens: 20 is less than the longest prompt"),
    ("bad-slots", edit("max_new_tokens: 16", "max_new_tokens: 16\n  slots: many"), [],
     "13:10", "generate.slots: must be a valid integer, or must be 'auto' (got 'many')"),
    ("zero-slots", edit("max_new_tokens: 16", "max_new_tokens: 16\n  slots: 0"), [],
     "13:10", "generate.slots: must be > 0, or must be 'auto' (got 0)"),
    ("stop-ids", edit("{eos: auto}", "{eos: auto, ids: [2]}"), [], "14:21",
     "generate.stop.ids: unknown key 'ids'; did you mean 'token_ids'?"),
    ("bad-eos", edit("{eos: auto}", "{eos: always}"), [], "14:15",
     "generate.stop.eos: must be 'auto' or 'none' (got 'always')"),
    ("negative-stop-id", edit("{eos: auto}", "{eos: auto, token_ids: [2, -1]}"), [], "14:36",
     "generate.stop.token_ids[1]: must be >= 0 (got -1)"),
    ("greedy-min-p", edit("{method: greedy}", "{method: greedy, min_p: 0.1}"), [], "13:13",
     "min_p 0.1 given with method greedy"),
    ("min-p-over-one", edit("{method: greedy}", "{method: sample, min_p: 1.5}"), [], "13:37",
     "generate.sampling.min_p: must be <= 1 (got 1.5)"),
    ("repetition-zero", edit("{method: greedy}", "{repetition_penalty: 0}"), [], "13:34",
     "generate.sampling.repetition_penalty: must be > 0 (got 0)"),
    ("presence-past-two", edit("{method: greedy}", "{presence_penalty: 2.5}"), [], "13:32",
     "generate.sampling.presence_penalty: must be <= 2 (got 2.5)"),
    ("logprobs-past-twenty", edit("max_new_tokens: 16", "max_new_tokens: 16\n  logprobs: 21"),
     [], "13:13", "generate.logprobs: must be <= 20 (got 21)"),
    ("kv-blocks-under-one-record",
     edit("max_new_tokens: 16", "max_new_tokens: 16\n  kv_blocks: 3"), [], "13:14",
     "generate.kv_blocks: 3 blocks of 16 tokens cannot hold one record: the longest prompt "
     "(32, the largest buckets.seq) and max_new_tokens (16) take 3, and one more is the trash "
     "block: give 4 or more"),
    ("override-located", GEN_SPEC, ["generate.min_new_tokens=99"], "--set",
     "--set generate.min_new_tokens=99: generate.min_new_tokens: 99 is more than"),
]


@pytest.mark.parametrize("case,text,overrides,where,message", BROKEN,
                         ids=[b[0] for b in BROKEN])
def test_broken_generation_spec_names_where_and_what(write_gen, case, text, overrides, where,
                                                     message):
    found = problems(write_gen(text), overrides)
    hits = [p for p in found if message in p]
    assert hits, found
    assert len(hits) == 1, hits  # a union's members' complaints are one problem
    if where == "--set":
        assert hits[0].startswith("--set"), hits
    elif where is not None:
        assert hits[0].split(": ", 1)[0].endswith(f"gen.yaml:{where}"), hits


def test_every_generation_rule_is_reported_at_once(write_gen):
    text = edit("class: AutoModelForCausalLM", "class: AutoModel").replace(
        "  text: {field: prompt}\n", "") + "inputs:\n  x: {shape: [batch, 4]}\n"
    found = problems(write_gen(text))
    assert any("AutoModel is no causal LM" in p for p in found), found
    assert any("the prompts are text" in p for p in found), found
    assert any("the inputs are implied" in p for p in found), found
    assert not any("used by no input shape" in p for p in found), found


def test_builtin_llama_generates_with_a_tokenizer(write_gen):
    text = edit("  hf: {path: model, class: AutoModelForCausalLM}\n",
                "  builtin: llama\n").replace("text: {field: prompt}",
                                              "text: {field: prompt, tokenizer: model}")
    assert load_spec(write_gen(text)).model.builtin == "llama"


def test_builtin_llama_without_generate_says_to_add_it(write_spec):
    text = MLP_SPEC.replace("builtin: mlp", "builtin: llama")
    found = problems(write_spec(text))
    assert any(p.endswith("5:12: model.builtin: the builtin llama is a generating model: add "
                          "a generate: section (generate: {max_new_tokens: 128}), or use the "
                          "builtin decoder for one step") for p in found), found


@pytest.mark.parametrize("key", ["inputs", "outputs"])
def test_a_forward_spec_still_needs_inputs_and_outputs(write_spec, key):
    lines = MLP_SPEC.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{key}:"))
    text = "".join(lines[:start] + lines[start + 2:])
    found = problems(write_spec(text))
    assert any(p.endswith(f"{key}: required key {key!r} is missing") for p in found), found
    empty = "".join(lines[:start] + [f"{key}: {{}}\n"] + lines[start + 2:])
    found = problems(write_spec(empty))
    assert any(f"{key}: needs at least one {key[:-1]}" in p for p in found), found


def test_a_forward_spec_needs_buckets_and_a_generation_spec_plans_its_own(write_spec, write_gen):
    lines = MLP_SPEC.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("buckets:"))
    found = problems(write_spec("".join(lines[:start] + lines[start + 2:])))
    assert any(p.endswith("buckets: required key 'buckets' is missing (e.g. buckets: {batch: "
                          "[1, 8, 32]}); a generation spec plans its own") for p in found), found
    spec = load_spec(write_gen(GEN_SPEC.replace("buckets:\n  batch: [1, 4]\n  seq: [16, 32]\n",
                                                "")))
    assert spec.buckets == {"batch": "auto", "seq": "auto"}


@pytest.mark.parametrize("cls", ["LlamaForCausalLM", "GPT2LMHeadModel", "AutoModelForCausalLM"])
def test_causal_lm_classes_are_accepted(write_gen, cls):
    spec = load_spec(write_gen(edit("class: AutoModelForCausalLM", f"class: {cls}")))
    assert spec.model.hf.class_ == cls


def test_the_schema_refuses_what_the_rules_refuse():
    """The JSON schema editors check with says the same about inputs and greedy's keys."""
    jsonschema = pytest.importorskip("jsonschema")
    from graphrun.manifest.schema import build

    schema = build("pipeline")
    base = {"version": 1, "name": "g", "model": {"builtin": "llama"},
            "data": {"path": "p.jsonl", "text": {"field": "prompt"}},
            "buckets": {"batch": [1], "seq": [8]}, "output": {"dir": "o"}}
    ok = dict(base, generate={"max_new_tokens": 4})
    jsonschema.validate(ok, schema)
    for bad in (dict(ok, inputs={"x": {"shape": ["batch"]}}), base,
                dict(base, generate={"sampling": {"method": "greedy", "top_k": 3}}),
                dict(base, generate={"sampling": {"temperature": 0.5}})):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_the_shipped_generation_pipeline_validates():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = load_spec(root / "pipelines" / "generate.yaml")
    assert spec.model.hf.class_ == "AutoModelForCausalLM"
    assert spec.model.hf.path == "../examples/models/tiny-llama"
    assert spec.data.path == root / "examples" / "data" / "prompts.jsonl"
    assert spec.buckets == {"batch": [1, 4, 16], "seq": [32, 64, 128, 256, 512]}
    assert (spec.generate.max_new_tokens, spec.generate.sampling.method) == (32, "greedy")
    assert spec.output.format == "jsonl" and spec.inputs == {}


def test_a_prompt_bucket_and_its_new_tokens_past_the_positions_is_located(write_gen, tmp_path):
    """A prompt and its new tokens share the model's positions: validate says so at the seq
    list (the run would stop only once the model is built)."""
    (tmp_path / "model" / "config.json").write_text('{"max_position_embeddings": 40}')
    found = problems(write_gen())
    assert any(p.split(": ", 1)[0].endswith("gen.yaml:17:8") and
               "buckets.seq: 32 + generate.max_new_tokens (16) is past the model's 40 positions"
               in p and "end the list at 24 or below" in p for p in found), found
    (tmp_path / "model" / "config.json").write_text('{"max_position_embeddings": 48}')
    assert load_spec(write_gen()).buckets["seq"] == [16, 32]


def test_temperature_zero_is_greedy_as_openai_and_vllm_read_it(write_gen):
    path = write_gen(edit("{method: greedy}", "{method: sample, temperature: 0, top_p: 0.5}"))
    sampling = load_spec(path).generate.sampling
    assert (sampling.method, sampling.temperature, sampling.top_p) == ("greedy", 1.0, 1.0)


def test_a_stop_id_past_the_model_s_vocabulary_is_refused_at_validate(write_gen, tmp_path):
    (tmp_path / "model" / "config.json").write_text('{"vocab_size": 1000}')
    text = edit("stop: {eos: auto}", "stop: {eos: auto, token_ids: [2, 99999]}")
    found = problems(write_gen(text))
    assert len(found) == 1 and "generate.stop.token_ids" in found[0], found
    assert "99999 past the model's vocabulary of 1000 (config.json's vocab_size)" in found[0]
    assert load_spec(write_gen(edit("stop: {eos: auto}", "stop: {token_ids: [999]}")))
    # the builtin llama: its vocabulary is model.args.vocab
    builtin = edit("  hf: {path: model, class: AutoModelForCausalLM}",
                   "  builtin: llama\n  args: {vocab: 64}")
    found = problems(write_gen(edited(builtin, "stop: {eos: auto}", "stop: {token_ids: [64]}")))
    assert any("64 past the model's vocabulary of 64 (model.args.vocab)" in p for p in found)


def any_problems(path) -> list[str]:
    """problems(path), or none where the spec loads."""
    from graphrun import SpecError

    try:
        load_spec(path)
    except SpecError as err:
        return [str(p) for p in err.problems]
    return []


def test_enough_kv_blocks_for_one_record_validate(write_gen):
    assert any_problems(write_gen(edit("max_new_tokens: 16",
                                       "max_new_tokens: 16\n  kv_blocks: 4"))) == []


@pytest.mark.parametrize("given", [False, True])
def test_a_tokenizer_folder_without_a_tokenizer_is_refused_at_validate(write_gen, tmp_path,
                                                                        given):
    """The model folder holds no tokenizer files and data.text.tokenizer is not given (or
    names another such folder): validate says which folder and what to save there, instead of
    the run failing in transformers' conversion of a slow tokenizer."""
    (tmp_path / "model" / "tokenizer.json").unlink()
    text = GEN_SPEC
    if given:
        (tmp_path / "tok").mkdir()
        (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
        text = edit("text: {field: prompt}", "text: {field: prompt, tokenizer: tok}")
    found = [p for p in problems(write_gen(text)) if "data.text.tokenizer" in p]
    assert len(found) == 1, found
    folder = tmp_path / ("tok" if given else "model")
    assert f"{folder} holds no tokenizer" in found[0] or f"{folder} holds none" in found[0]
    assert "save_pretrained" in found[0]
    (folder / "vocab.json").write_text("{}")  # a slow tokenizer's files are enough
    assert any_problems(write_gen(text)) == []


def test_an_output_dir_that_is_a_file_is_refused_at_validate(write_gen, tmp_path):
    (tmp_path / "out").write_text("not a folder")
    found = [p for p in problems(write_gen()) if "output.dir" in p]
    assert len(found) == 1 and "is a file, not a folder" in found[0], found


def test_prefill_tokens_beside_a_seq_planned_from_the_prompts_loads(write_gen):
    """buckets.seq: auto has no largest value yet to hold prefill_tokens against; the rule
    compared a number with the word auto (a TypeError's traceback)."""
    spec = load_spec(write_gen(edit("max_new_tokens: 16",
                                    "max_new_tokens: 16\n  prefill_tokens: 64")),
                     ["buckets.seq=auto"])
    assert spec.generate.prefill_tokens == 64 and spec.buckets["seq"] == "auto"
