"""Where a tokenizer folder's chat template is, found as transformers finds it. One finder for
the spec's check (does the folder have one?) and for read/chat (which compiles it). No jinja,
no torch."""

from __future__ import annotations

import json
from pathlib import Path

from graphrun.base.errors import InputError

FILES = ("chat_template.jinja", "tokenizer_config.json", "chat_template.json")


def folder_template(folder) -> tuple[str | None, str]:
    """(the folder's chat template, the file it is in): chat_template.jinja, else
    tokenizer_config.json's chat_template, else chat_template.json's (a processor's); of named
    templates (a list of {name, template}), the one named default. (None, the folder) if none."""
    base = Path(folder)
    jinja = base / FILES[0]
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), str(jinja)
    for name in FILES[1:]:
        value = read_json(base / name).get("chat_template")
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            if "default" not in named:
                raise InputError(f"chat_template holds the templates {sorted(map(str, named))} "
                                 "and none named default: name a template file in "
                                 "data.chat.template", where=str(base / name))
            value = named["default"]
        if value:
            if not isinstance(value, str):
                raise InputError("chat_template: expected the template's text",
                                 where=str(base / name))
            return value, str(base / name)
    return None, str(base)


def no_chat_template(folder) -> str:
    return (f"the tokenizer in {folder} has no chat template (chat_template.jinja, or "
            "tokenizer_config.json's chat_template): name a template file in "
            "data.chat.template, or render the prompts yourself and give data.text with "
            "add_special_tokens: false")


def read_json(path: Path) -> dict:
    """A JSON object file's contents; {} for a file that is missing, unreadable or not an
    object (the folder's other checks report those)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
