"""``TextStream``: a request's tokens as text, piece by piece, cut at its stop strings.

Text is decoded incrementally: the tokens since the last complete piece are decoded with the
token before them for context, and a piece is released only once it no longer ends in an
incomplete character (``U+FFFD``). Stop strings are matched on the text, across token
boundaries; the tail that could still become a stop string is held back, so no part of a stop
string ever reaches the client. When one matches, the text ends just before it.

>>> from servecore.testing import word_tokenizer
>>> t = TextStream(word_tokenizer(32), stop=["w11 w12"])
>>> [t.add(tok) for tok in (17, 11, 18, 11, 12, 19)]
['w17', ' ', 'w11 w18', ' ', '', '']
>>> t.stopped, t.text
(True, 'w17 w11 w18 ')
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TextStream"]


class TextStream:
    """The text of one request's tokens (see the module docstring): ``add`` each token as it
    comes, ``finish`` at the end; each returns the text that may be sent now. ``stopped``:
    a stop string matched (add nothing more); ``text``: everything released.

    >>> from servecore.testing import word_tokenizer
    >>> t = TextStream(word_tokenizer(32))
    >>> t.add(17) + t.add(18) + t.finish()
    'w17 w18'
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self._prefix = 0  # tokens[_prefix:_read] were decoded last time, for context
        self._read = 0
        self._decoded = ""  # the text of every complete piece so far
        self.text = ""  # released to the client
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def add(self, token: int) -> str:
        """Take one more token; the text now safe to send (maybe empty)."""
        if self.stopped:
            return ""
        self.tokens.append(int(token))
        before = self.tokenizer.decode(self.tokens[self._prefix : self._read])
        after = self.tokenizer.decode(self.tokens[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._decoded += after[len(before) :]
            self._prefix, self._read = self._read, len(self.tokens)
        return self._release(final=False)

    def finish(self) -> str:
        """No more tokens: the text still held back (an incomplete character decodes as it
        is; a stop string's possible beginning is released)."""
        if not self.stopped and self._read < len(self.tokens):
            before = self.tokenizer.decode(self.tokens[self._prefix : self._read])
            after = self.tokenizer.decode(self.tokens[self._prefix :])
            self._decoded += after[len(before) :]
            self._read = len(self.tokens)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        start = len(self.text)
        hits = [(i, s) for i, s in ((self._decoded.find(s, max(0, start - len(s) + 1)), s)
                                    for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            end, self.matched = min(hits)
        else:
            end = len(self._decoded) - (0 if final else self._partial_stop())
        piece = self._decoded[start:end] if end > start else ""
        self.text += piece
        return piece

    def _partial_stop(self) -> int:
        """The longest tail of the decoded text that begins some stop string (held back)."""
        best = 0
        unsent = len(self._decoded) - len(self.text)  # (sent text never starts a stop string)
        for s in self.stop:
            for k in range(min(len(s) - 1, unsent), best, -1):
                if self._decoded.endswith(s[:k]):
                    best = k
                    break
        return best
