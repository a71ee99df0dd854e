"""Chat messages into a prompt: an OpenAI message list checked, then rendered by the model's
chat template (transformers' apply_chat_template, which runs the Jinja template in a sandboxed
environment, with add_generation_prompt), the text then tokenized without adding special
tokens again: the template wrote them.
"""

from __future__ import annotations

import functools
from pathlib import Path

from graphrun.base.errors import InputError
from graphrun.spec.keys import PipelineSpec
from graphrun.spec.rules import no_chat_template

ROLES = ("system", "developer", "user", "assistant")


def check_messages(messages, named: str) -> list[dict] | str:
    """OpenAI messages -> [{role, content: str}] (text parts joined by newlines, as vLLM
    joins them for a template that takes strings), or why they cannot be rendered."""
    if not isinstance(messages, list) or not messages:
        return f"{named}: expected a non-empty list of messages [{{role, content}}, ...]"
    out = []
    for k, m in enumerate(messages):
        where = f"{named}[{k}]"
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return f"{where}: expected an object with role and content"
        if m["role"] not in ROLES:
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


class ChatTemplate:
    """The tokenizer's chat template (or the spec's data.chat.template file), rendering one
    conversation at a time so that one bad conversation rejects only its record."""

    def __init__(self, folder: str, template: str | None, trust_remote_code: bool = False):
        from graphrun.models.hf import refuse_remote_code, require

        transformers = require("transformers", "data.chat")
        if not trust_remote_code:
            refuse_remote_code(folder, f"data.chat tokenizer {folder!r}",
                               "set model.hf.trust_remote_code: true")
        # passed either way: left out, transformers would ask on stdin
        self.tok = transformers.AutoTokenizer.from_pretrained(
            folder, local_files_only=True, trust_remote_code=trust_remote_code)
        self.template = template
        if template is None and not self.tok.chat_template:
            raise InputError(no_chat_template(folder), where="data.chat")

    def render(self, messages: list[dict]) -> str | tuple[str]:
        """(the prompt,) or why the template refused the conversation."""
        try:
            return (self.tok.apply_chat_template(messages, chat_template=self.template,
                                                 add_generation_prompt=True, tokenize=False),)
        except Exception as e:  # noqa: BLE001 - the template's own raise_exception, say
            return f"the chat template refused the messages: {e}"


@functools.lru_cache(maxsize=4)
def _template(folder: str, path: str | None, trust_remote_code: bool) -> ChatTemplate:
    text = Path(path).read_text(encoding="utf-8") if path else None
    return ChatTemplate(folder, text, trust_remote_code)


def chat_template(spec: PipelineSpec) -> ChatTemplate:
    from graphrun.models.hf import remote_code, tokenizer_folder

    path = spec.data.chat.template if spec.data.chat else None
    return _template(tokenizer_folder(spec), str(spec.base_dir / path) if path else None,
                     remote_code(spec))
