"""Chat messages into a prompt: an OpenAI message list checked, then rendered by the model's
chat template (Jinja in a sandbox, with add_generation_prompt, as transformers'
apply_chat_template renders it, without importing transformers), the text then tokenized
without adding special tokens again: the template wrote them.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from graphrun.base.errors import InputError, first_line
from graphrun.read.requests import shown
from graphrun.spec.keys import PipelineSpec
from graphrun.spec.chat_template import folder_template, no_chat_template, read_json

ROLES = ("system", "developer", "user", "assistant")


def check_messages(messages, named: str) -> list[dict] | str:
    """OpenAI messages -> [{role, content: str}] (text parts joined by newlines, as vLLM
    joins them for a template that takes strings), or why they cannot be rendered."""
    if not isinstance(messages, list) or not messages:
        return f"{named}: expected a non-empty list of messages [{{role, content}}, ...]"
    out = []
    for k, m in enumerate(messages):
        where = f"{named}[{k}]"
        if not isinstance(m, dict):
            return f"{where}: expected an object with role and content, got {_kind(m)}"
        missing = [key for key in ("role", "content") if key not in m]
        if missing:
            return f"{where}: {' and '.join(missing)} missing (a message has role and content)"
        if m["role"] not in ROLES:
            if not isinstance(m["role"], str):
                return f"{where}: role {shown(m['role'])}: give one of {', '.join(ROLES)}"
            return (f"{where}: role {m['role']!r} is not served (give {', '.join(ROLES)}; "
                    "tool calls are not)")
        extra = sorted(k for k, v in m.items() if k not in ("role", "content", "name")
                       and v is not None)
        if extra:
            return f"{where}: {extra[0]!r} is not served (role, content, name)"
        content = _text(m["content"], where)
        if not isinstance(content, tuple):
            return content
        out.append({**m, "content": content[0]})
    return out


def _text(content, where: str) -> tuple[str] | str:
    if isinstance(content, str):
        return (content,)
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                return (f"{where}.content[{j}]: a part of type {kind!r}; only text parts "
                        "({type: text, text: ...}) are served")
            texts.append(part["text"])
        return ("\n".join(texts),)
    return f"{where}.content: expected a string or a list of text parts"


# the tokenizer's named special tokens a template reads (bos_token, ...), as transformers
# passes them to apply_chat_template's render
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
JINJA_MIN = (3, 1, 6)  # older releases have known sandbox escapes; a template is untrusted code


class Refused(Exception):
    """A template's raise_exception(message)."""


class ChatTemplate:
    """The tokenizer's chat template (or the spec's data.chat.template file), compiled once and
    rendering one conversation at a time, so that one bad conversation rejects only its record.

    Rendered as transformers' apply_chat_template renders it (tests/test_chat_template.py holds
    the two equal), without importing transformers: Jinja's sandbox that allows no change to a value
    passed in, blocks trimmed and left-stripped, loop controls, tojson without HTML escaping,
    raise_exception and strftime_now; the variables messages, add_generation_prompt, tools and
    documents (None) and the tokenizer's named special tokens. A `{% generation %}` block
    renders its body (transformers marks the assistant's tokens with it)."""

    def __init__(self, folder: str, template: str | None, where: str | None = None):
        source, where = (template, where) if template is not None else folder_template(folder)
        if source is None:
            raise InputError(no_chat_template(folder), where="data.chat")
        self.tokens = special_tokens(Path(folder))
        env = _environment()  # its own error (an old jinja2) is not the template's
        try:
            self.compiled = env.from_string(source)
        except Exception as e:  # noqa: BLE001 - jinja's TemplateSyntaxError, with its line
            line = getattr(e, "lineno", None)
            raise InputError(f"the chat template does not compile: {first_line(e)}"
                             + (f" (its line {line})" if line else "")
                             + "; fix it, or name another in data.chat.template",
                             where=where) from None

    def render(self, messages: list[dict]) -> str | tuple[str]:
        """(the prompt,) or why the template refused the conversation."""
        try:
            return (self.compiled.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=True, **self.tokens),)
        except Refused as e:  # the template's own raise_exception: its message
            return f"the chat template refused the messages: {e}"
        except Exception as e:  # noqa: BLE001 - the sandbox's refusal, an undefined name, ...
            return f"the chat template refused the messages: {first_line(e)}"


def special_tokens(folder: Path) -> dict[str, str]:
    """The named special tokens' texts: tokenizer_config.json's, else special_tokens_map.json's
    (each a string, or an added token's {content: ...})."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the second wins
        for key, value in read_json(folder / name).items():
            if isinstance(value, dict):
                value = value.get("content")
            if key in SPECIAL_TOKENS and isinstance(value, str):
                found[key] = value
    return found


@functools.lru_cache(maxsize=1)
def _environment():
    """Jinja's sandbox as chat templates expect it (ChatTemplate's docstring)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    have = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if have < JINJA_MIN:
        raise InputError(f"chat templates need jinja2 >= {'.'.join(map(str, JINJA_MIN))} "
                         f"(this is {jinja2.__version__}, with known sandbox escapes): "
                         "pip install -U jinja2", where="data.chat")

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: its body, as written."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    class Namespace(jinja2.utils.Namespace):
        """namespace(): no attribute of a leading underscore, set or given."""

        def __init__(*args, **kwargs):  # jinja's own signature: `self` may be a kwarg
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._plain(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._plain(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _plain(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template may not set {name!r} on a namespace")

    def raise_exception(message):
        raise Refused(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, namespace=Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       # a function, not the type: no dict.fromkeys or other class attributes
                       dict=lambda *a, **k: dict(*a, **k))
    return env


@functools.lru_cache(maxsize=4)
def _template(folder: str, path: str | None) -> ChatTemplate:
    text = Path(path).read_text(encoding="utf-8") if path else None
    return ChatTemplate(folder, text, path)


def chat_template(spec: PipelineSpec) -> ChatTemplate:
    from graphrun.models.hf import tokenizer_folder

    path = spec.data.chat.template if spec.data.chat else None
    return _template(tokenizer_folder(spec), str(spec.base_dir / path) if path else None)


def _kind(v) -> str:
    """A JSON value's kind, for a message that is no object."""
    return {str: "a string", list: "a list", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__)
