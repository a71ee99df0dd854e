"""An OpenAI Batch file's endpoint (data.format: openai_batch). OpenAI's Batch API takes one
endpoint per file; so does graphrun: the url of the file's first request it serves. The spec's
checks (a chat template needed) and the reader and writer of the file read it here alike."""

from __future__ import annotations

import functools
import json
from pathlib import Path

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)


@functools.lru_cache(maxsize=8)
def _endpoint(path: str, stamp: tuple) -> str | None:
    with open(path, "rb") as f:
        for raw in f:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if isinstance(line, dict) and line.get("url") in ENDPOINTS:
                return line["url"]
    return None


def file_endpoint(path) -> str | None:
    """The url of the file's first request whose url graphrun serves (None: none has one, or
    the file cannot be read)."""
    try:
        st = Path(path).stat()
        return _endpoint(str(path), (st.st_size, st.st_mtime_ns))
    except OSError:
        return None
