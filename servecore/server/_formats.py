"""How each generation route writes its answer: the whole object, or its stream of
server-sent events. One class per route (``ChatFormat``, ``CompletionFormat``,
``MessagesFormat``) with the same four methods, so ``servecore.server.app`` drives them all
alike.

>>> f = ChatFormat("m", n=1, include_usage=False)
>>> [e.decode().split('"delta":')[1][:33] for e in f.piece(Piece(0, "hi"))]
['{"role":"assistant","content":""}', '{"content":"hi"},"logprobs":null,']
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from servecore.server import _anthropic_api as anthropic_api
from servecore.server import _openai_api as openai_api
from servecore.server._errors import APIError
from servecore.server._generation import Piece, Usage

__all__ = ["ChatFormat", "CompletionFormat", "MessagesFormat"]


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event (``data`` as compact JSON, or a string as it is).

    >>> sse({"type": "ping"}, "ping")
    b'event: ping\\ndata: {"type":"ping"}\\n\\n'
    """
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return (f"event: {event}\n" if event else "").encode() + f"data: {text}\n\n".encode()


class ChatFormat:
    """``/v1/chat/completions``: a ``chat.completion`` or its chunks, ``data: [DONE]`` last.
    ``keepalive`` is what a stream sends while nothing happens.

    >>> f = ChatFormat("m", n=1, include_usage=True)
    >>> f.complete(["w5"], ["stop"], [None], Usage(3, 1))["choices"][0]["message"]["content"]
    'w5'
    >>> f.tail(Usage(3, 1))[-1]
    b'data: [DONE]\\n\\n'
    """

    keepalive = b": keep-alive\n\n"

    def __init__(self, model: str, n: int, include_usage: bool,
                 text_of: Callable[[int], str] | None = None):
        self.model, self.n, self.include_usage = model, n, include_usage
        self.text_of = text_of  # a token's text; given: the call asked for logprobs
        self.id, self.created = openai_api.new_id("chatcmpl"), int(time.time())
        self._started: set[int] = set()
        self._offsets: dict[int, int] = {}  # choice -> its text so far (completions)

    def error(self, e: APIError) -> dict[str, Any]:
        """The error object of this API."""
        return e.openai()

    def complete(self, texts: list[str], finish: list[str | None], stops: list[str | None],
                 usage: Usage, entries: list[list] | None = None) -> dict[str, Any]:
        """The whole answer: each choice's text, finish reason and stop string (``entries``:
        each choice's ``(token, TokenLogprobs)``)."""
        return openai_api.chat_response(self.id, self.model, texts, finish, usage,
                                        self._logprobs(entries))

    def _logprobs(self, entries):
        if self.text_of is None or entries is None:
            return None
        return [openai_api.chat_logprobs(e, self.text_of) for e in entries]

    def head(self) -> list[bytes]:
        """The events a stream opens with."""
        return []

    def piece(self, p: Piece, usage: Usage | None = None) -> list[bytes]:
        """The events of one piece of text (``usage``: the call's so far)."""
        out = []
        if p.index not in self._started:  # each choice opens with its role
            self._started.add(p.index)
            out.append(sse(self._chunk(p.index, {"role": "assistant", "content": ""})))
        if p.text or (p.logprobs and self.text_of is not None):
            lp = (openai_api.chat_logprobs(p.logprobs, self.text_of)
                  if self.text_of is not None else None)
            out.append(sse(self._chunk(p.index, {"content": p.text}, logprobs=lp)))
        if p.finish_reason is not None:
            out.append(sse(self._chunk(p.index, {}, p.finish_reason)))
        return out

    def _chunk(self, index, delta, finish=None, usage=None, logprobs=None):
        return openai_api.chat_chunk(self.id, self.model, self.created, index, delta, finish,
                                     usage, logprobs)

    def tail(self, usage: Usage) -> list[bytes]:
        """The events a stream ends with."""
        out = [sse(self._chunk(None, {}, usage=usage))] if self.include_usage else []
        return out + [sse("[DONE]")]

    def stream_error(self, e: APIError) -> list[bytes]:
        """The events that end a stream with an error."""
        return [sse(e.openai()), sse("[DONE]")]


class CompletionFormat(ChatFormat):
    """``/v1/completions``: a ``text_completion`` or its chunks, ``data: [DONE]`` last.

    >>> CompletionFormat("m", 1, False).piece(Piece(0, "", None))  # nothing to say yet
    []
    """

    def __init__(self, model: str, n: int, include_usage: bool,
                 text_of: Callable[[int], str] | None = None):
        super().__init__(model, n, include_usage, text_of)
        self.id = openai_api.new_id("cmpl")

    def complete(self, texts, finish, stops, usage, entries=None):
        """The whole answer: each choice's text, finish reason and stop string."""
        lps = None
        if self.text_of is not None and entries is not None:
            lps = [openai_api.completion_logprobs(e, self.text_of) for e in entries]
        return openai_api.completion_response(self.id, self.model, texts, finish, usage, lps)

    def piece(self, p: Piece, usage: Usage | None = None) -> list[bytes]:
        """The events of one piece of text (``usage``: the call's so far)."""
        lp = None
        if self.text_of is not None:
            at = self._offsets.get(p.index, 0)
            lp = openai_api.completion_logprobs(p.logprobs, self.text_of, at)
            self._offsets[p.index] = at + sum(len(t) for t in lp["tokens"])
        if not p.text and p.finish_reason is None and not p.logprobs:
            return []
        return [sse(openai_api.completion_chunk(self.id, self.model, self.created, p.index,
                                                p.text, p.finish_reason, logprobs=lp))]

    def tail(self, usage: Usage) -> list[bytes]:
        """The events a stream ends with."""
        out = [sse(openai_api.completion_chunk(self.id, self.model, self.created, None,
                                               usage=usage))] if self.include_usage else []
        return out + [sse("[DONE]")]


class MessagesFormat:
    """``/v1/messages``: a ``message`` or its event sequence (``message_start`` once the
    first token says what the cache served, a text block's deltas, ``message_delta`` with the
    stop reason and usage, ``message_stop``).

    >>> f = MessagesFormat("m")
    >>> [e.split(b"\\n")[0] for e in f.piece(Piece(0, "w5", "stop", "w6"), Usage(3, 1))]
    [b'event: message_start', b'event: content_block_start', b'event: content_block_delta']
    >>> f.complete(["w5"], ["stop"], ["w6"], Usage(3, 1))["stop_reason"]
    'stop_sequence'
    """

    keepalive = sse({"type": "ping"}, "ping")

    def __init__(self, model: str, n: int = 1, include_usage: bool = True):
        self.model, self.id = model, anthropic_api.new_id()
        self._open = False
        self._reason, self._stop = "end_turn", None

    def error(self, e: APIError) -> dict[str, Any]:
        """The error object of this API."""
        return e.anthropic()

    def complete(self, texts, finish, stops, usage, entries=None):
        """The whole answer: each choice's text, finish reason and stop string."""
        return anthropic_api.message_response(
            self.id, self.model, texts[0], anthropic_api.stop_reason(finish[0], stops[0]),
            stops[0], usage)

    def head(self) -> list[bytes]:
        """The events a stream opens with."""
        return []

    def _start(self, usage: Usage) -> list[bytes]:
        self._open = True
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": anthropic_api.usage_object(usage)}
        return [sse({"type": "message_start", "message": message}, "message_start"),
                sse({"type": "content_block_start", "index": 0,
                     "content_block": {"type": "text", "text": ""}}, "content_block_start")]

    def piece(self, p: Piece, usage: Usage | None = None) -> list[bytes]:
        """The events of one piece of text (``usage``: the call's so far)."""
        out = [] if self._open else self._start(usage or Usage())
        if p.text:
            out.append(sse({"type": "content_block_delta", "index": 0,
                            "delta": {"type": "text_delta", "text": p.text}},
                           "content_block_delta"))
        if p.finish_reason is not None:
            self._reason = anthropic_api.stop_reason(p.finish_reason, p.stop)
            self._stop = p.stop
        return out

    def tail(self, usage: Usage) -> list[bytes]:
        """The events a stream ends with."""
        out = [] if self._open else self._start(usage)
        return out + [
            sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
            sse({"type": "message_delta", "delta": {"stop_reason": self._reason,
                                                    "stop_sequence": self._stop},
                 "usage": anthropic_api.usage_object(usage)}, "message_delta"),
            sse({"type": "message_stop"}, "message_stop")]

    def stream_error(self, e: APIError) -> list[bytes]:
        """The events that end a stream with an error."""
        return [sse(e.anthropic(), "error")]
