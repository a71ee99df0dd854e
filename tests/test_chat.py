"""Chat records (data.chat) and text that holds its special tokens (data.text.add_special_tokens
false): rendered by the model's chat template, tokenized once, greedy completions equal to
transformers' generate on apply_chat_template's ids; bad conversations rejected with their
lines; a model without a template refused before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

import graphrun
from graphrun.base.errors import GraphrunError

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "examples" / "models" / "tiny-llama"
NEW = 5
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
            "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHATS = [
    [{"role": "system", "content": "You answer briefly."},
     {"role": "user", "content": "Where did the fisherman find the orchid?"}],
    [{"role": "user", "content": [{"type": "text", "text": "Describe the storm."},
                                  {"type": "text", "text": "In one line."}]}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Tell me about the committee."}],
]


def chat_model(folder: Path, template: str | None = TEMPLATE) -> Path:
    """The shipped tiny Llama with a chat template in its tokenizer_config.json."""
    shutil.copytree(FOLDER, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def write_job(tmp_path: Path, records: list[dict], data: dict, model: Path, **top) -> Path:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = {"version": 1, "name": "chat", "device": "cpu",
            "model": {"hf": {"path": str(model), "class": "AutoModelForCausalLM"},
                      "dtype": "float32"},
            "data": {"path": str(path), "id_field": "id", "batch_size": 2, **data},
            "generate": {"max_new_tokens": NEW},
            "buckets": {"batch": [1, 2], "seq": [64, 128]},
            "output": {"dir": str(tmp_path / "out"), "format": "jsonl"}, **top}
    out = tmp_path / "chat.yaml"
    out.write_text(yaml.safe_dump(spec))
    return out


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(out.glob("part-*.jsonl"))
            for line in p.read_text().splitlines()]


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen2_chat_model(folder: Path) -> Path:
    """A seeded 2-layer Qwen2 layout beside the tiny Llama's tokenizer, with a ChatML template
    that writes no BOS (as Qwen's): the prompt is the template's text, no token added."""
    import transformers

    from tests.generate_models import _spread

    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256,
                                      bos_token_id=0, eos_token_id=1, pad_token_id=1)
    _spread(transformers.Qwen2ForCausalLM(config).eval()).save_pretrained(folder)
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(FOLDER / name, folder / name)
    tok = json.loads((FOLDER / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tok, "chat_template": CHATML}))
    return folder


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def layout(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param) / "tiny-chat"
    return chat_model(folder) if request.param == "llama" else qwen2_chat_model(folder)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("m") / "tiny-chat")


@pytest.fixture(scope="module")
def hf(model_dir):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    lm = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return tok, lm


def hf_chat_greedy(hf, messages) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy new ids) as transformers makes them from apply_chat_template."""
    tok, lm = hf
    flat = [{**m, "content": m["content"] if isinstance(m["content"], str)
             else "\n".join(p["text"] for p in m["content"])} for m in messages]
    ids = tok.apply_chat_template(flat, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    ids = torch.tensor([list(ids)])
    with torch.no_grad():
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                          do_sample=False)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


def test_chat_completions_equal_transformers_generate_on_the_chat_template(tmp_path, layout):
    import transformers

    hf = (transformers.AutoTokenizer.from_pretrained(layout),
          transformers.AutoModelForCausalLM.from_pretrained(layout).eval())
    records = [{"id": f"c{i}", "messages": m} for i, m in enumerate(CHATS)]
    spec = write_job(tmp_path, records, {"chat": {"field": "messages"}}, layout)
    manifest = graphrun.run(graphrun.load_spec(spec))
    got = rows(tmp_path / "out")
    assert [r["id"] for r in got] == ["c0", "c1", "c2"]
    bos = 1 if "bos_token" in hf[0].chat_template else 0
    for row, messages in zip(got, CHATS):
        prompt, want = hf_chat_greedy(hf, messages)
        assert prompt.count(hf[0].bos_token_id) == bos  # the template's BOS, none added
        assert row["prompt_tokens"] == len(prompt)
        assert row["token_ids"] == want, row["id"]
    assert manifest.environment.model_code == "graphrun"  # its own Llama, for both layouts


def test_text_holding_its_special_tokens_is_not_given_them_again(tmp_path, model_dir, hf):
    tok = hf[0]
    rendered = tok.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False)
    records = [{"id": "t0", "prompt": rendered}]
    spec = write_job(tmp_path, records, {"text": {"field": "prompt",
                                                  "add_special_tokens": False}}, model_dir)
    graphrun.run(graphrun.load_spec(spec))
    prompt, want = hf_chat_greedy(hf, CHATS[0])
    (row,) = rows(tmp_path / "out")
    assert row["prompt_tokens"] == len(prompt)
    assert row["token_ids"] == want


def test_bad_conversations_are_rejected_with_their_lines(tmp_path, model_dir):
    records = [{"id": "ok", "messages": CHATS[0]},
               {"id": "str", "messages": "hello"},
               {"id": "image", "messages": [{"role": "user", "content": [
                   {"type": "image_url", "image_url": {"url": "x"}}]}]},
               {"id": "tool", "messages": [{"role": "tool", "content": "x"}]},
               {"id": "empty", "messages": []},
               {"id": "null role", "messages": [{"role": None, "content": "x"}]}]
    spec = write_job(tmp_path, records, {"chat": {}, "on_bad_record": "skip"}, model_dir)
    manifest = graphrun.run(graphrun.load_spec(spec))
    assert [r["id"] for r in rows(tmp_path / "out")] == ["ok"]
    rejects = {json.loads(x)["id"]: json.loads(x) for x in
               (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()}
    assert set(rejects) == {"str", "image", "tool", "empty", "null role"}
    assert "role null: give one of system" in rejects["null role"]["reason"]
    assert rejects["str"]["where"].endswith("chats.jsonl:2")
    assert "list of messages" in rejects["str"]["reason"]
    assert "image_url" in rejects["image"]["reason"]
    assert "'tool'" in rejects["tool"]["reason"]
    assert manifest.totals.records_rejected == 5


def test_messages_read_as_data_text_say_to_read_them_with_data_chat(tmp_path, model_dir):
    records = [{"id": "c0", "messages": CHATS[0]}]
    spec = write_job(tmp_path, records, {"text": {"field": "messages"}}, model_dir)
    with pytest.raises(graphrun.InputError) as err:
        graphrun.run(graphrun.load_spec(spec))
    assert "chats.jsonl:1" in str(err.value)
    assert ("messages: holds chat messages, not a prompt's text or token ids: read it with "
            "data.chat: {field: messages} in place of data.text") in str(err.value)


def test_a_model_without_a_chat_template_is_refused_before_any_work(tmp_path):
    bare = chat_model(tmp_path / "bare", template=None)
    spec = write_job(tmp_path, [{"id": "c0", "messages": CHATS[0]}], {"chat": {}}, bare)
    with pytest.raises(GraphrunError, match="no chat template.*data.chat.template"):
        graphrun.load_spec(spec)
    assert not (tmp_path / "out").exists()


def test_the_spec_check_finds_a_template_where_the_renderer_does(tmp_path):
    bare = chat_model(tmp_path / "bare", template=None)
    spec = write_job(tmp_path, [{"id": "c0", "messages": CHATS[0]}], {"chat": {}}, bare)
    (bare / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    graphrun.load_spec(spec)  # a processor's chat_template.json is a template
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": TEMPLATE}]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(GraphrunError, match=r"data\.chat.*tokenizer_config\.json.*"
                       r"\['tool_use'\] and none named default"):
        graphrun.load_spec(spec)
    assert not (tmp_path / "out").exists()


def test_a_template_file_named_in_the_spec_serves_a_model_without_one(tmp_path, hf):
    bare = chat_model(tmp_path / "bare", template=None)
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    spec = write_job(tmp_path, [{"id": "c0", "messages": CHATS[0]}],
                     {"chat": {"template": "chat.jinja"}}, bare)
    graphrun.run(graphrun.load_spec(spec))
    (row,) = rows(tmp_path / "out")
    assert row["token_ids"] == hf_chat_greedy(hf, CHATS[0])[1]


def test_chat_alone_implies_generation_buckets_and_jsonl(tmp_path, model_dir):
    spec = write_job(tmp_path, [{"id": "c0", "messages": CHATS[0]}], {"chat": {}}, model_dir)
    raw = yaml.safe_load(spec.read_text())
    del raw["generate"], raw["buckets"], raw["output"]["format"]
    spec.write_text(yaml.safe_dump(raw))
    loaded = graphrun.load_spec(spec)
    assert loaded.generate is not None and loaded.buckets == {"batch": "auto", "seq": "auto"}
    assert loaded.output.format == "jsonl" and loaded.data.text.truncate is False
    manifest = graphrun.run(loaded)
    assert manifest.totals.records_out == 1


def test_validate_load_plans_the_auto_buckets_a_chat_spec_implies(tmp_path, model_dir):
    from click.testing import CliRunner

    from graphrun.cli.main import main

    spec = write_job(tmp_path, [{"id": f"c{i}", "messages": m} for i, m in enumerate(CHATS)],
                     {"chat": {}}, model_dir)
    raw = yaml.safe_load(spec.read_text())
    del raw["buckets"]
    spec.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(main, ["validate", "--load", str(spec)])
    assert result.exit_code == 0, result.output
    assert "ok (model built, called on each of" in result.output
