"""The engine protocol: what an engine implements so that the shared layers serve it.

An engine is two halves. Its *core* (``EngineCore``) owns the model, the pools and the
scheduler, and knows requests by an integer id only: it queues them, cancels them and runs one
scheduling round at a time, reporting every token it commits as an ``Event``. The shared
``servecore.streams.Streams`` is the other half: it assigns ids, builds and checks requests
(``servecore.requests``), owns the per-request outboxes, and gives every user the same
contract (``generate``, ``stream``, ``add_request`` / ``step`` / ``abort``), whichever engine
is underneath; the front door ``servecore.client.EngineClient`` holds it, and a server (or
any other front end) talks to that only.

The core's promises:

* ``submit(rid, request)`` queues a checked request; nothing runs until a round does.
* ``cancel(rid)`` drops a queued or running request at once, freeing what it holds, and
  returns whether it was live; it may be called at any time outside a round.
* ``run_round(emit)`` runs one round (admit, schedule, one step or run of steps, finish) and
  calls ``emit(Event(rid, token, finished))`` for every token it commits, in order; it returns
  whether anything ran or was committed. A round that fails then raises the exception, after
  one of two things: it drops the requests it was serving and emits
  ``Event(rid, None, True, error)`` for each (mlxcache), or it was a transaction that left
  every request as it was, emitting nothing, and the next round runs them again
  (hybridattn: its device step commits nothing that failed).
* ``has_work()``: whether any request is queued, running or has tokens in flight.
* ``close()``: release what the core holds for serving (pools, buffers, requests); no other
  call follows (``Streams.close`` makes sure). Idempotent.

An ``Engine`` is a ``servecore.client.EngineClient`` over its core: the front door's calls,
and read-only views of its core's parts (``delegate``).

>>> Event(3, 17, False)
Event(rid=3, token=17, finished=False, error=None, cached=None, logprobs=None)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

from servecore.requests import GenerationRequest

__all__ = ["EngineCore", "Event", "TokenLogprobs", "delegate"]

_REQUIRED = object()


class TokenLogprobs(NamedTuple):
    """A generated token's log-probability and the ``k`` most likely tokens' (``(id,
    logprob)``, most likely first, ties to the lower id), for a request that asked for
    ``logprobs=k``: the log-softmax of the model's logits at that position in float32, before
    temperature, top-k and top-p.

    >>> TokenLogprobs(-0.1, ((5, -0.1), (9, -2.4))).top[1]
    (9, -2.4)
    """

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Event(NamedTuple):
    """One token of request ``rid`` (``token`` is None when the request ended without one:
    it was aborted, or a round serving it failed with ``error``). A request's first token
    carries ``cached``: how many of its prompt tokens the prefix cache served (0 on a miss;
    None on later tokens, and from a core that does not say). A request that asked for
    ``logprobs`` gets them with each token (``TokenLogprobs``).

    >>> Event(0, None, True, error=RuntimeError("step failed")).finished
    True
    >>> Event(0, 17, False, cached=96).cached
    96
    """

    rid: int
    token: int | None
    finished: bool
    error: BaseException | None = None
    cached: int | None = None
    logprobs: TokenLogprobs | None = None


@runtime_checkable
class EngineCore(Protocol):
    """What an engine's core implements (see the module docstring).

    >>> class Idle:
    ...     def submit(self, rid, request): ...
    ...     def cancel(self, rid): return False
    ...     def run_round(self, emit): return False
    ...     def has_work(self): return False
    ...     def close(self): ...
    >>> isinstance(Idle(), EngineCore)
    True
    """

    def submit(self, rid: int, request: GenerationRequest) -> None:
        """Queue ``request`` under id ``rid``."""

    def cancel(self, rid: int) -> bool:
        """Drop request ``rid`` (queued or running); whether it was live."""

    def run_round(self, emit: Callable[[Event], None]) -> bool:
        """One scheduling round; ``emit`` each committed token; whether anything ran."""

    def has_work(self) -> bool:
        """Whether any request is queued, running or has tokens in flight."""

    def close(self) -> None:
        """Release the pools and buffers; the last call the core gets (idempotent)."""


def delegate(path: str, doc: str, *, missing: Any = _REQUIRED) -> property:
    """A read-only property that reads ``path`` (dotted attribute names) off the instance: a
    facade's view of a part of its core. With ``missing``, a part that is None on the way
    (an engine without a prefix cache) gives ``missing`` instead.

    >>> class Core:
    ...     store = None
    ...     waiting = [1, 2]
    >>> class Facade:
    ...     core = Core()
    ...     waiting = delegate("core.waiting", "Queued requests.")
    ...     num_slots = delegate("core.store.num_slots", "Pool slots.", missing=0)
    >>> Facade().waiting, Facade().num_slots, Facade.num_slots.__doc__
    ([1, 2], 0, 'Pool slots.')
    """
    names = path.split(".")

    def get(self: Any) -> Any:
        x = self
        for name in names:
            if x is None and missing is not _REQUIRED:
                return missing
            x = getattr(x, name)
        return x

    return property(get, doc=doc)
