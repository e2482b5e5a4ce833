"""``APIError``: what a bad request or a fault becomes on the wire.

One exception for every refusal, raised wherever the fault is found (parsing, validation,
the engine's own checks) and rendered once, in the shape of the API the client called:
OpenAI's ``{"error": {"message", "type", "param", "code"}}`` or Anthropic's ``{"type":
"error", "error": {"type", "message"}}``.

>>> e = APIError(400, "max_tokens must be an int >= 1, not -1", param="max_tokens")
>>> e.openai()["error"]["param"], e.anthropic()["error"]["type"]
('max_tokens', 'invalid_request_error')
"""

from __future__ import annotations

from typing import Any

__all__ = ["APIError", "shaped"]

# status -> (OpenAI's error type, Anthropic's)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    499: ("invalid_request_error", "invalid_request_error"),  # the client left
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


class APIError(Exception):
    """A request the server refuses (``status`` 4xx) or could not serve (5xx), with the
    field it names (``param``) and a machine-readable ``code``.

    >>> APIError(404, "no model 'x'", code="model_not_found").openai()["error"]["type"]
    'not_found_error'
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def openai(self) -> dict[str, Any]:
        """The OpenAI error object."""
        kind = _TYPES.get(self.status, ("server_error", "api_error"))[0]
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}

    def anthropic(self) -> dict[str, Any]:
        """The Anthropic error object."""
        kind = _TYPES.get(self.status, ("server_error", "api_error"))[1]
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def shaped(path: str, e: APIError) -> dict[str, Any]:
    """``e`` in the shape of the API ``path`` belongs to (Anthropic's under ``/v1/messages``,
    else OpenAI's).

    >>> shaped("/v1/messages", APIError(401, "no key"))["error"]["type"]
    'authentication_error'
    """
    return e.anthropic() if path.startswith("/v1/messages") else e.openai()
