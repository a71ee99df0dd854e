"""graphrun's chat template (read/chat.ChatTemplate) renders what transformers'
apply_chat_template renders, over templates that use what real ones use; a template's refusal
rejects its record only; a template that does not compile is one error naming its file and line;
the sandbox holds; a chat job imports no transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from graphrun.base.errors import InputError
from graphrun.read.chat import ChatTemplate, check_messages

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "examples" / "models" / "tiny-llama"

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
          "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + "
          "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}")
# namespace, loop controls, tojson, dict(), the generation tag, tools and documents, and
# whitespace that trim_blocks and lstrip_blocks shape
FEATURES = """{%- set ns = namespace(system='none') -%}
{%- for m in messages -%}
    {%- if m.role == 'system' %}{% set ns.system = m.content %}{% continue %}{% endif -%}
    {% generation %}<{{ m.role }}>{{ m.content | tojson }}</{{ m.role }}>{% endgeneration %}
    {% if loop.index > 3 %}{% break %}{% endif %}
{%- endfor %}
    {% if tools is not none %}TOOLS{% endif %}{% if documents %}DOCS{% endif %}
[{{ ns.system }}] {{ dict(a=1, b=[2, 'é']) | tojson }} {{ pad_token }}|{{ unk_token }}
{% if add_generation_prompt %}
    <assistant>
{% endif %}"""

CHATS = [
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "  Where is the orchid?\n  Say <b>&</b> \"quoted\" ☃ é  "}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Tell me\n\tabout it."},
     {"role": "assistant", "content": "No."}, {"role": "user", "content": "Again."}],
    [{"role": "user", "content": [{"type": "text", "text": "Part one."},
                                  {"type": "text", "text": "Part two."}]}],
]


def folder_with(tmp_path: Path, template: str | None, where: str = "config") -> Path:
    """The shipped tiny Llama's tokenizer with `template`: in tokenizer_config.json, or in
    chat_template.jinja beside it."""
    folder = tmp_path / "tok"
    shutil.copytree(FOLDER, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None and where == "config":
        config["chat_template"] = template
    elif template is not None:
        (folder / "chat_template.jinja").write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("template", ["shipped", LLAMA3, CHATML, FEATURES],
                         ids=["shipped", "llama3", "chatml", "features"])
@pytest.mark.parametrize("where", ["config", "jinja"])
def test_renders_what_transformers_renders(tmp_path, template, where):
    transformers = pytest.importorskip("transformers")
    if template == "shipped":
        folder = FOLDER
    else:
        folder = folder_with(tmp_path, template, where)
    ours = ChatTemplate(str(folder), None)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    for chat in CHATS:
        messages = check_messages(chat, "messages")
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours.render(messages) == (want,)
    if template == FEATURES:  # the features all ran: not an empty render that matches
        text = ours.render(check_messages(CHATS[0], "m"))[0]
        assert '<user>"  Where is the orchid?\\n  Say <b>&</b> \\"quoted\\" ☃ é  "</user>' in text
        assert '[Be brief.] {"a": 1, "b": [2, "é"]} </s>|' in text


def test_a_refusal_is_the_records_reason(tmp_path):
    ours = ChatTemplate(str(folder_with(tmp_path, ALTERNATING)), None)
    fine = ours.render(check_messages(CHATS[1], "m"))
    assert fine == ("<s>[INST] Hi [/INST]Hello.</s>[INST] Tell me\n\tabout it. [/INST]No.</s>"
                    "[INST] Again. [/INST]",)
    why = ours.render(check_messages(CHATS[0], "m"))
    assert why == ("the chat template refused the messages: Conversation roles must "
                   "alternate user/assistant")


def test_a_template_that_does_not_compile_names_its_file_and_line(tmp_path):
    folder = folder_with(tmp_path, "{% for m in messages %}\n{{ m.content }\n{% endfor %}",
                         where="jinja")
    with pytest.raises(InputError, match=r"does not compile: .*its line 2.*data\.chat\.template"
                       ) as err:
        ChatTemplate(str(folder), None)
    assert str(folder / "chat_template.jinja") in str(err.value)


def test_named_templates_take_the_default_and_a_folder_without_one_is_refused(tmp_path):
    folder = folder_with(tmp_path, None)
    with pytest.raises(InputError, match="no chat template"):
        ChatTemplate(str(folder), None)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"},
                               {"name": "default", "template": CHATML}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate(str(folder), None).render([{"role": "user", "content": "x"}]) == (
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n",)
    config["chat_template"] = [{"name": "tool_use", "template": "T"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"\['tool_use'\] and none named default"):
        ChatTemplate(str(folder), None)


def test_chat_template_json_serves_a_tokenizer_without_one_and_a_jinja_file_comes_first(
        tmp_path):
    folder = folder_with(tmp_path, None)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": CHATML}))
    hi = [{"role": "user", "content": "hi"}]
    assert ChatTemplate(str(folder), None).render(hi) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",)
    (folder / "chat_template.jinja").write_text("{{ messages[0].content }}!")
    assert ChatTemplate(str(folder), None).render(hi) == ("hi!",)


@pytest.mark.parametrize("body", [
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{{ namespace(_x=1) }}",
    "{{ messages.append(1) }}",
    "{{ messages.__class__.__mro__ }}",
    "{{ ''.__class__.__subclasses__() }}",
])
def test_the_sandbox_holds(tmp_path, body):
    ours = ChatTemplate(str(folder_with(tmp_path, body)), None)
    messages = [{"role": "user", "content": "x"}]
    out = ours.render(messages)
    assert isinstance(out, str) and out.startswith("the chat template refused the messages")
    assert messages == [{"role": "user", "content": "x"}]
    # an attribute the sandbox withholds is undefined: printed, it is nothing
    assert ChatTemplate(str(tmp_path / "tok"), "{{ ''.__class__ }}").render(messages) == ("",)


def test_a_chat_job_imports_no_transformers(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "messages": c}) + "\n"
                             for i, c in enumerate(CHATS)))
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps({
        "version": 1, "name": "chat", "device": "cpu",
        "model": {"hf": {"path": str(FOLDER), "class": "AutoModelForCausalLM"},
                  "dtype": "float32"},
        "data": {"path": str(chats), "id_field": "id", "chat": {"field": "messages"}},
        "generate": {"max_new_tokens": 3},
        "output": {"dir": str(tmp_path / "out"), "format": "jsonl"}}))
    code = ("import sys, graphrun\n"
            f"graphrun.run(graphrun.load_spec({str(spec)!r}))\n"
            "print('transformers' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False"
    rows = (tmp_path / "out" / "part-00000.jsonl").read_text().splitlines()
    assert [json.loads(r)["id"] for r in rows] == ["c0", "c1", "c2"]


@pytest.mark.parametrize("message, why", [
    ({"content": "hi"}, "messages[0]: role missing (a message has role and content)"),
    ({"role": "user"}, "messages[0]: content missing (a message has role and content)"),
    ({}, "messages[0]: role and content missing (a message has role and content)"),
    ("hi", "messages[0]: expected an object with role and content, got a string"),
    (None, "messages[0]: expected an object with role and content, got null"),
])
def test_a_message_that_lacks_a_key_or_is_no_object_says_which(message, why):
    assert check_messages([message], "messages") == why
