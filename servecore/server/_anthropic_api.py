"""The Anthropic Messages API's shapes: ``/v1/messages`` and ``/v1/messages/count_tokens``
requests read into an ``Ask``, and the message and stream events they answer with.

Fields read: ``model``, ``system`` (a string or text blocks), ``messages`` (text content or
text blocks), ``max_tokens`` (required), ``temperature`` (0 to 1), ``top_p``, ``top_k``,
``stop_sequences``, ``stream``. ``tools``, ``tool_choice`` and ``thinking`` are accepted only
empty or off; any other field is a 400 naming it.

>>> from servecore.testing import word_tokenizer
>>> ask = parse_messages({"model": "m", "max_tokens": 3, "messages": [
...     {"role": "user", "content": "w7"}]}, word_tokenizer(32), vocab_size=32)
>>> ask.max_tokens, ask.temperature, len(ask.prompts)
(3, 1.0, 1)
"""

from __future__ import annotations

import uuid
from typing import Any

from servecore.server._fields import Fields, text_parts
from servecore.server._generation import Ask, Usage
from servecore.server._openai_api import _encode

__all__ = ["parse_count_tokens", "parse_messages"]

MAX_STOP = 8


def _blocks(value: Any, where: str) -> str:
    """A string, or a list of text blocks joined (``fields.text_parts``)."""
    return text_parts(value, where, ignored=("cache_control", "citations"))


def _chat(f: Fields) -> list[dict[str, str]]:
    """The system prompt and messages as one chat."""
    chat = []
    if f.has("system"):
        chat.append({"role": "system", "content": _blocks(f.get("system"), "system")})
    f.seen.add("system")
    messages = f.required("messages")
    if not isinstance(messages, list) or not messages:
        raise f.fail("messages", "messages must be a non-empty list of messages")
    for i, m in enumerate(messages):
        g = Fields(m, f"messages[{i}]", prefix=f"messages[{i}].")
        role = g.string("role", required=True)
        if role not in ("user", "assistant"):
            raise g.fail("role", f"messages[{i}].role must be 'user' or 'assistant', not "
                         f"{role!r}")
        chat.append({"role": role, "content": _blocks(g.required("content"),
                                                      f"messages[{i}].content")})
        g.finish()
    if chat[-1]["role"] == "assistant":
        raise f.fail("messages", "the last message is the assistant's (a prefill to continue): "
                     "this server does not continue one; end with a user message")
    return chat


def _unsupported(f: Fields) -> None:
    f.unsupported("tools", [])
    f.unsupported("tool_choice", {"type": "none"}, {"type": "auto"})
    f.unsupported("thinking", {"type": "disabled"})
    f.unsupported("mcp_servers", [])
    f.unsupported("container")
    f.unsupported("service_tier", "auto", "standard_only")
    f.ignored("metadata")


def parse_messages(body: Any, tokenizer: Any, *, vocab_size: int) -> Ask:
    """A ``/v1/messages`` body as an ``Ask``; 400 naming the field when it is wrong.

    >>> from servecore.testing import word_tokenizer
    >>> parse_messages({"model": "m", "messages": [{"role": "user", "content": "w7"}]},
    ...                word_tokenizer(32), vocab_size=32)
    Traceback (most recent call last):
    ...
    servecore.server._errors.APIError: max_tokens is required
    """
    f = Fields(body)
    f.string("model", required=True)
    ask = Ask([_encode("messages", _chat(f), tokenizer, vocab_size)], prompt_field="messages")
    ask.max_tokens = f.integer("max_tokens", None, lo=1, required=True)
    ask.temperature = f.number("temperature", 1.0, lo=0.0, hi=1.0)
    ask.top_p = f.number("top_p", 1.0, lo=0.0, hi=1.0)
    if ask.top_p == 0.0:
        raise f.fail("top_p", "top_p must be > 0")
    ask.top_k = f.integer("top_k", 0, lo=0, hi=2**31 - 1)
    ask.stop = f.strings("stop_sequences", most=MAX_STOP)
    ask.stream = f.boolean("stream", False)
    _unsupported(f)
    f.finish()
    return ask


def parse_count_tokens(body: Any, tokenizer: Any, *, vocab_size: int) -> int:
    """The input tokens a ``/v1/messages/count_tokens`` body's prompt takes.

    >>> from servecore.testing import word_tokenizer
    >>> parse_count_tokens({"model": "m", "system": "w5", "messages": [
    ...     {"role": "user", "content": [{"type": "text", "text": "w7 w8"}]}]},
    ...     word_tokenizer(32), vocab_size=32) > 3
    True
    """
    f = Fields(body)
    f.string("model", required=True)
    tokens = _encode("messages", _chat(f), tokenizer, vocab_size)
    _unsupported(f)
    f.finish()
    return len(tokens)


def stop_reason(finish: str | None, stopped_by: str | None) -> str:
    """Anthropic's ``stop_reason`` of a finish reason (``stopped_by``: the stop string)."""
    if stopped_by is not None:
        return "stop_sequence"
    return "max_tokens" if finish == "length" else "end_turn"


def usage_object(u: Usage) -> dict[str, Any]:
    """Anthropic's ``usage``: ``input_tokens`` are the prompt tokens the cache did not serve;
    ``cache_read_input_tokens`` those it did (the counter of OpenAI's ``cached_tokens``)."""
    return {"input_tokens": u.prompt_tokens - u.cached_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens,
            "output_tokens": u.completion_tokens}


def new_id() -> str:
    """A fresh message id."""
    return f"msg_{uuid.uuid4().hex[:24]}"


def message_response(mid: str, model: str, text: str, reason: str, stop_sequence: str | None,
                     usage: Usage) -> dict[str, Any]:
    """A complete ``message`` object."""
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}], "stop_reason": reason,
            "stop_sequence": stop_sequence, "usage": usage_object(usage)}
