"""``Fields``: a JSON request body read field by field, each refusal naming the field.

Every field a route reads goes through one of its typed getters; ``finish`` then refuses the
fields nobody read, so nothing a client sends is silently ignored. A field the server knows
but does not implement is accepted only at its default (``unsupported``).

>>> f = Fields({"max_tokens": 0, "temperature": 0.5, "tools": [], "frobnicate": 1})
>>> f.number("temperature", 1.0, lo=0, hi=2)
0.5
>>> f.unsupported("tools", None, [])
>>> f.integer("max_tokens", 16, lo=1)
Traceback (most recent call last):
...
servecore.server._errors.APIError: max_tokens must be an integer >= 1, not 0
>>> f.finish()
Traceback (most recent call last):
...
servecore.server._errors.APIError: unrecognized request argument supplied: frobnicate
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from servecore.server._errors import APIError

__all__ = ["Fields", "parse_json", "text_parts"]

_MISSING = object()


def parse_json(raw: bytes) -> Any:
    r"""The JSON of a request body, or a 400 saying why it is not JSON. A string that holds
    half of a UTF-16 surrogate pair (``"\ud800"``: JSON allows it, no text has it) is
    refused too, naming where it is: no tokenizer, log or answer can carry it.

    >>> parse_json(b'{"a": 1}')
    {'a': 1}
    >>> parse_json(rb'{"a": ["ok", "\ud83d\ude00", "\ud800"]}')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    servecore.server._errors.APIError: the request body holds a lone UTF-16 surrogate ... in a[2]
    """
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    if _SURROGATE_ESCAPE.search(raw):  # (a pair decodes to one character: only then look)
        where = _lone_surrogate(body, "")
        if where is not None:
            raise APIError(400, "the request body holds a lone UTF-16 surrogate (half of a "
                           f"pair, not text) in {where or 'the body'}",
                           param=where.split("[")[0].split(".")[0] or None)
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
"""A surrogate escaped in JSON (``\\ud800``), or encoded raw in UTF-8 (``json.loads`` lets
both through)."""


def _lone_surrogate(x: Any, path: str) -> str | None:
    """Where in ``x`` a string (a key or a value) fails to encode as UTF-8, or None."""
    if isinstance(x, str):
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(x, dict):
        for k, v in x.items():
            name = f"{path}.{k}" if path else str(k)
            try:
                k.encode("utf-8")
            except UnicodeEncodeError:
                return path or "a field's name"
            found = _lone_surrogate(v, name)
            if found is not None:
                return found
    if isinstance(x, list):
        for i, v in enumerate(x):
            found = _lone_surrogate(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


class Fields:
    """The fields of one JSON object (``what`` names it in errors, ``prefix`` before each
    field's name; see the module docstring).

    >>> Fields({"role": 3}, "messages[0]", prefix="messages[0].").string("role")
    Traceback (most recent call last):
    ...
    servecore.server._errors.APIError: messages[0].role must be a string, not int
    """

    def __init__(self, body: Any, what: str = "the request body", prefix: str = ""):
        if not isinstance(body, dict):
            raise APIError(400, f"{what} must be a JSON object, not {type(body).__name__}",
                           param=prefix.rstrip(".") or None)
        self.body, self.prefix, self.seen = body, prefix, set()

    def has(self, name: str) -> bool:
        """Whether the field is present and not null."""
        return self.body.get(name) is not None

    def get(self, name: str, default: Any = None) -> Any:
        """The raw value (null reads as ``default``)."""
        self.seen.add(name)
        value = self.body.get(name, _MISSING)
        return default if value is _MISSING or value is None else value

    def fail(self, name: str, message: str) -> APIError:
        """The 400 about field ``name``."""
        return APIError(400, message, param=self.prefix + name)

    def required(self, name: str) -> Any:
        """The value of a field that must be there."""
        value = self.get(name)
        if value is None:
            raise self.fail(name, f"{self.prefix}{name} is required")
        return value

    def integer(self, name: str, default: Any, *, lo: int | None = None,
                hi: int | None = None, required: bool = False) -> Any:
        """An integer field within ``[lo, hi]``."""
        value = self.required(name) if required else self.get(name, default)
        if value is default and not required:
            return value
        bound = " and ".join(b for b in (f">= {lo}" if lo is not None else "",
                                         f"<= {hi}" if hi is not None else "") if b)
        if (isinstance(value, bool) or not isinstance(value, int)
                or (lo is not None and value < lo) or (hi is not None and value > hi)):
            raise self.fail(name, f"{self.prefix}{name} must be an integer"
                            + (f" {bound}" if bound else "") + f", not {value!r}")
        return value

    def number(self, name: str, default: float, *, lo: float, hi: float) -> float:
        """A number field within ``[lo, hi]``."""
        value = self.get(name, default)
        try:
            finite = not isinstance(value, bool) and math.isfinite(float(value))
        except (TypeError, ValueError, OverflowError):
            finite = False
        if not finite or not isinstance(value, int | float) or not lo <= value <= hi:
            raise self.fail(name, f"{self.prefix}{name} must be a number in [{lo}, {hi}], "
                            f"not {value!r}")
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        """A true / false field."""
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise self.fail(name, f"{self.prefix}{name} must be true or false, not {value!r}")
        return value

    def string(self, name: str, default: Any = None, *, required: bool = False) -> Any:
        """A string field."""
        value = self.required(name) if required else self.get(name, default)
        if value is not default and not isinstance(value, str):
            raise self.fail(name, f"{self.prefix}{name} must be a string, not "
                            f"{type(value).__name__}")
        return value

    def strings(self, name: str, *, most: int, longest: int = 1000) -> list[str]:
        """A string or a list of at most ``most`` strings (stop sequences), each of 1 to
        ``longest`` characters."""
        value = self.get(name, [])
        items = [value] if isinstance(value, str) else value
        if (not isinstance(items, list) or len(items) > most
                or not all(isinstance(s, str) and 0 < len(s) <= longest for s in items)):
            raise self.fail(name, f"{self.prefix}{name} must be a string or a list of at most "
                            f"{most} strings, each of 1 to {longest} characters, not "
                            f"{str(value)[:80]!r}")
        return items

    def unsupported(self, name: str, *defaults: Any) -> None:
        """A field this server does not implement: absent, null or one of ``defaults``."""
        value = self.get(name)
        if value is not None and not any(value == d and type(value) is type(d)
                                         for d in defaults):
            raise self.fail(name, f"{self.prefix}{name} is not supported by this server "
                            f"(got {json.dumps(value)[:80]}); leave it out")

    def ignored(self, *names: str) -> None:
        """Fields that change nothing here (``user``, ``metadata``): read and dropped."""
        self.seen.update(names)

    def finish(self) -> None:
        """Refuse any field no getter read."""
        extra = sorted(set(self.body) - self.seen)
        if extra:
            raise APIError(400, f"unrecognized request argument supplied: {extra[0]}",
                           param=self.prefix + extra[0])


def text_parts(value: Any, where: str, ignored: tuple[str, ...] = ("cache_control",)) -> str:
    """Content as both APIs give it: a string, or a list of ``{"type": "text", "text": ...}``
    parts, joined (``ignored``: the part fields read and dropped); 400 naming ``where``.

    >>> text_parts([{"type": "text", "text": "w5 "}, {"type": "text", "text": "w6"}], "content")
    'w5 w6'
    >>> try:
    ...     text_parts([{"type": "image"}], "messages[0].content")
    ... except APIError as e:
    ...     print(e.status, e.param)
    400 messages[0].content[0].type
    """
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(value):
        p = Fields(part, f"{where}[{j}]", prefix=f"{where}[{j}].")
        if p.string("type", required=True) != "text":
            raise p.fail("type", f"{where}[{j}].type must be 'text' (this server reads text "
                         "only)")
        texts.append(p.string("text", required=True))
        p.ignored(*ignored)
        p.finish()
    return "".join(texts)
