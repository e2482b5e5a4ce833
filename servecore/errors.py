"""The errors both engines raise alike: ``InvalidRequest`` (a request refused at the door,
naming its field), ``PoolExhausted`` (a host-side allocation asked for more slots than are
free) and ``EngineClosedError`` (a call to an engine after its ``close()``).

One class each for both engines (``hybridattn.PoolExhausted`` and
``mlxcache.pool.PoolExhausted`` are this class), with the numbers as attributes.
"""

from __future__ import annotations

__all__ = ["EngineClosedError", "InvalidRequest", "PoolExhausted"]


class InvalidRequest(ValueError):
    """A request an engine refuses before anything changed: ``field`` names the argument
    (``prompt``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
    ``stop_token_ids``, ``logprobs``), ``value`` is what was given (a prompt's token count, not
    the prompt), ``reason`` the message (``str(e)``), which names both. A ``ValueError``, so
    code that catches those still does.

    >>> e = InvalidRequest("max_tokens=0 must be >= 1", field="max_tokens", value=0)
    >>> e.field, e.value, e.reason
    ('max_tokens', 0, 'max_tokens=0 must be >= 1')
    """

    def __init__(self, reason: str, *, field: str, value: object = None):
        super().__init__(reason)
        self.reason, self.field, self.value = reason, field, value

    def __reduce__(self):  # picklable with its attributes
        return (_invalid_request, (self.reason, self.field, self.value))


def _invalid_request(reason: str, field: str, value: object) -> InvalidRequest:
    return InvalidRequest(reason, field=field, value=value)


class PoolExhausted(RuntimeError):
    """More slots were requested than are free (after any eviction the caller tried).

    ``requested`` and ``available`` are the numbers; ``what`` names the pool and
    ``capacity``, when given, is its size.

    >>> e = PoolExhausted(requested=40, available=12, what="token slots", capacity=63)
    >>> str(e), e.requested, e.available
    ('token slots exhausted: requested 40, 12 available of 63', 40, 12)
    """

    def __init__(self, requested: int, available: int, what: str = "slots",
                 capacity: int | None = None):
        self.requested = int(requested)
        self.available = int(available)
        self.what = what
        self.capacity = capacity
        of = f" of {capacity}" if capacity is not None else ""
        super().__init__(f"{what} exhausted: requested {self.requested}, "
                         f"{self.available} available{of}")

    def __reduce__(self):  # picklable with its numbers (xdist, multiprocessing)
        return (type(self), (self.requested, self.available, self.what, self.capacity))


class EngineClosedError(RuntimeError):
    """A call to an engine after its ``close()`` (the message names the engine); also what
    a stream that was still unfinished when its engine closed raises, once its tokens made
    before the close are read."""
