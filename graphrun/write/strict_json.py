"""JSON lines every reader takes: Python's json writes NaN and Infinity bare, which orjson, jq
and JavaScript refuse. A non-finite number is written as its name in a string ("NaN",
"Infinity", "-Infinity"), a lone surrogate (UTF-8 cannot encode "\\ud800") as its escape's
text; a line holding neither is written as json.dumps writes it.
"""

from __future__ import annotations

import json


def strict_dumps(value, **options) -> str:
    """json.dumps(value, **options), strict: see the module's docstring."""
    try:
        line = json.dumps(value, allow_nan=False, **options)
        if not options.get("ensure_ascii", True):
            line.encode("utf-8")
        elif "\\ud" in line:  # a surrogate's escape: one alone is no character
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        return line
    except (ValueError, UnicodeEncodeError):
        return json.dumps(_strict(value), **options)


def _strict(value):
    if isinstance(value, float) and (value != value or abs(value) == float("inf")):
        return json.dumps(value)  # NaN, Infinity, -Infinity
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_strict(str(k)): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value
