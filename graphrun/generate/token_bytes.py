"""A token's own bytes, and how a logprob output names it.

Decoding one token alone loses what a logprob needs: a byte-level token holding part of a
character decodes to U+FFFD, and a SentencePiece decoder drops the leading space of the first
token it decodes. So the bytes are read from the token's piece, the way the tokenizer's decoder
would turn it into text (tokenizers' decoder description):
- ByteLevel (GPT-2, Llama 3, Qwen): each character of the piece stands for one byte (GPT-2's
  byte-to-character table);
- ByteFallback (Llama 2, Mistral): a piece `<0xNN>` is the byte NN;
- Replace and Metaspace: the word-start mark (U+2581) is a space;
- special and added tokens: their text. Any other decoder: the token decoded alone.

A logprob output's token text is those bytes as UTF-8 where they are whole characters, else
`bytes:` and each byte as `\\xNN` (OpenAI's convention for a part of a character);
text_bytes() reads such a text back.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Callable

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
PARTIAL = "bytes:"  # the prefix of a token text that is not whole characters


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: a piece's character -> its byte. Printable
    bytes stand for themselves; the others, in order, for characters from U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, n = {b: b for b in kept}, 0
    for b in range(256):
        if b not in chars:
            chars[b], n = 256 + n, n + 1
    return {chr(c): b for b, c in chars.items()}


def _steps(tokenizer) -> list[dict]:
    """The tokenizer's decoder as a list of steps, each its description ({"type": ...})."""
    decoder = getattr(tokenizer, "decoder", None)
    if decoder is None:
        return []
    try:
        d = json.loads(decoder.__getstate__())
    except Exception:  # noqa: BLE001 - a decoder that cannot describe itself: decode alone
        return [{"type": "unknown"}]
    return d.get("decoders", []) if d.get("type") == "Sequence" else [d]


def token_bytes(tokenizer) -> Callable[[int], bytes]:
    """token id -> its bytes (see the module's docstring), for a `tokenizers.Tokenizer`; each
    id read once."""
    steps = _steps(tokenizer)
    kinds = {s.get("type") for s in steps}
    alphabet = byte_alphabet() if "ByteLevel" in kinds else None
    marks = {s["replacement"] for s in steps if s.get("type") == "Metaspace"}
    marks |= {s["pattern"]["String"] for s in steps if s.get("type") == "Replace"
              and s.get("content") == " " and "String" in s.get("pattern", {})}
    known = kinds <= {"ByteLevel", "ByteFallback", "Replace", "Metaspace", "Fuse", "Strip"}
    added = {i for i in getattr(tokenizer, "get_added_tokens_decoder", dict)()}

    def alone(i: int) -> bytes:
        return tokenizer.decode([i], skip_special_tokens=False).encode("utf-8")

    @lru_cache(maxsize=1 << 16)
    def of(i: int) -> bytes:
        piece = tokenizer.id_to_token(i)
        if piece is None or i in added or not known or not steps:
            return alone(i)
        if alphabet is not None:
            if all(ch in alphabet for ch in piece):
                return bytes(alphabet[ch] for ch in piece)
            return alone(i)
        if "ByteFallback" in kinds and (m := BYTE_PIECE.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        for mark in marks:
            piece = piece.replace(mark, " ")
        return piece.encode("utf-8")

    return of


def logprob_text(raw: bytes) -> str:
    """A token's text in a logprob output: its bytes as UTF-8, or `bytes:\\xNN...` where they
    are not whole characters."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return PARTIAL + "".join(f"\\x{b:02x}" for b in raw)


def text_bytes(text: str) -> list[int]:
    """logprob_text read back: the token's bytes."""
    if text.startswith(PARTIAL + "\\x"):
        hexes = text[len(PARTIAL):].split("\\x")[1:]
        if all(len(h) == 2 for h in hexes):
            try:
                return [int(h, 16) for h in hexes]
            except ValueError:
                pass
    return list(text.encode("utf-8"))


def token_texts(tokenizer) -> Callable[[int], str]:
    """token id -> logprob_text of its bytes, each id read once."""
    of = token_bytes(tokenizer)
    return lru_cache(maxsize=1 << 16)(lambda i: logprob_text(of(i)))
