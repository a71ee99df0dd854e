"""Stop strings, checked on a row's text as its tokens are read back (one step late, on the
host: no device sync of its own).

Each row with stop strings keeps its text, grown by incremental detokenization: the window from
the previous delta's start is decoded and the part past the previous text is the new text, held
back while it ends in an unfinished UTF-8 character (U+FFFD), as text-generation-inference and
vLLM do. Only the tail a new delta can complete is searched.
"""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"  # what a decode gives for the first bytes of an unfinished character


class StopText:
    """One row's text so far, and where its first stop string starts."""

    def __init__(self, strings: tuple[str, ...], detokenize: Callable[[list[int]], str]):
        self.strings, self.detokenize = strings, detokenize
        self.longest = max(len(s) for s in strings)
        self.text = ""
        self.prefix = self.read = 0  # token offsets: the decode window's start, the text's end

    def feed(self, tokens: list[int]) -> bool:
        """The row's tokens so far (one more than the last call's, or more): whether its text
        now holds a stop string."""
        before = self.detokenize(tokens[self.prefix:self.read])
        now = self.detokenize(tokens[self.prefix:])
        if len(now) <= len(before) or now.endswith(REPLACEMENT):
            return False
        delta = now[len(before):]
        self.prefix, self.read = self.read, len(tokens)
        self.text += delta
        start = max(0, len(self.text) - len(delta) - self.longest + 1)
        return any(self.text.find(s, start) >= 0 for s in self.strings)

    def cut(self, tokens: list[int]) -> str:
        """The completion's text, ending before its first stop string (the whole decode of its
        tokens, searched again, so that it equals the text a completion without one gets)."""
        text = self.detokenize(tokens)
        if not any(s in text for s in self.strings):
            text = self.text
        return text[:min((text.find(s) for s in self.strings if s in text), default=len(text))]
