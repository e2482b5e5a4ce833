"""``Door``: who may call the server, checked before any route runs (a pure ASGI middleware,
so a client's disconnect still reaches the routes).

The security model (docs/server.md): the server binds 127.0.0.1 by default, and three
checks keep what can reach it from using it uninvited:

* a web page the user visits can send requests to a local server, and a ``text/plain`` or
  form POST needs no CORS preflight. So a request that carries an ``Origin`` header (every
  browser sends one on such requests) is refused with a 403 unless its origin is one the
  server was started with (``--allowed-origins``; ``*`` for any); an allowed origin gets the
  CORS headers, and its preflight (``OPTIONS``) is answered. Clients that are not browsers
  send no ``Origin``. The routes also take JSON bodies only (a 415 otherwise).
* with an API key (``--api-key``), every ``/v1`` route needs it, as OpenAI's clients send it
  (``Authorization: Bearer KEY``) or Anthropic's (``x-api-key: KEY``): a 401 otherwise.
  ``/health`` and ``/metrics`` stay open.

>>> door = Door(None, api_key="k", allowed_origins=["http://localhost:3000"])
>>> door.allows_origin("http://localhost:3000"), door.allows_origin("https://evil.example")
(True, False)
>>> door.has_key({b"authorization": b"Bearer k"}), door.has_key({b"x-api-key": b"nope"})
(True, False)
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable
from typing import Any

from servecore.server._errors import APIError, shaped

__all__ = ["Door"]

_PREFLIGHT_HEADERS = b"authorization, content-type, x-api-key, anthropic-version"


class Door:
    """The checks of the module docstring around ``app``; ``api_key`` None: no key needed;
    ``allowed_origins``: the web origins whose pages may call (``*``: any)."""

    def __init__(self, app: Any, *, api_key: str | None = None,
                 allowed_origins: Iterable[str] = ()):
        self.app = app
        self.api_key = None if api_key is None else api_key.encode()
        self.origins = frozenset(allowed_origins)

    def allows_origin(self, origin: str) -> bool:
        """Whether a page of ``origin`` may call the server."""
        return "*" in self.origins or origin in self.origins

    def has_key(self, headers: dict[bytes, bytes]) -> bool:
        """Whether ``headers`` carry the API key (either client's way); True without one."""
        if self.api_key is None:
            return True
        bearer = headers.get(b"authorization", b"")
        given = bearer[7:] if bearer[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        return hmac.compare_digest(given, self.api_key)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        path, raw_origin = scope["path"], headers.get(b"origin")
        origin = None if raw_origin is None else raw_origin.decode("latin-1")
        if origin is not None and not self.allows_origin(origin):
            await _refuse(send, path, APIError(
                403, f"a request from the web origin {origin!r} is refused: a web page may call "
                "this server only if it was started with --allowed-origins naming that origin"))
            return
        cors = [] if origin is None else [(b"access-control-allow-origin", raw_origin),
                                          (b"vary", b"origin")]
        if origin is not None and scope["method"] == "OPTIONS":  # an allowed preflight
            await send({"type": "http.response.start", "status": 204, "headers": cors + [
                (b"access-control-allow-methods", b"GET, POST"),
                (b"access-control-allow-headers", _PREFLIGHT_HEADERS),
                (b"access-control-max-age", b"600")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if path.startswith("/v1/") and not self.has_key(headers):
            await _refuse(send, path, APIError(
                401, "this server needs an API key: send it as 'Authorization: Bearer KEY' "
                "(OpenAI's clients) or 'x-api-key: KEY' (Anthropic's)", code="invalid_api_key"),
                cors)
            return
        if not cors:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


async def _refuse(send: Any, path: str, e: APIError, extra: list | None = None) -> None:
    body = json.dumps(shaped(path, e)).encode()
    await send({"type": "http.response.start", "status": e.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *(extra or [])]})
    await send({"type": "http.response.body", "body": body})
