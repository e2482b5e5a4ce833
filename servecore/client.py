"""``EngineClient``: the one front door of both engines.

``hybridattn.Engine`` and ``mlxcache.Engine`` are subclasses: each builds its core (an
``servecore.engine.EngineCore``) and hands it here; every call a user or the server makes is
this class's, with one signature on both engines:

* ``generate(prompts, max_tokens, *, <sampling>, progress, text)``: the answers, whole;
* ``stream(prompts, max_tokens, *, <sampling>, progress)``: ``(prompt index, token)`` as
  they come (a ``servecore.streams.Stream``);
* ``add_request(prompt, max_tokens, *, <sampling>, logprobs)`` then ``step()`` or
  ``step_events()`` one round at a time, ``abort(rid)``, ``has_unfinished()``;
* ``close()`` (or a ``with`` block), ``closed``;
* ``tokenizer``, ``vocab_size``, ``eos_ids``, ``stats`` (a ``servecore.ServingStats``) and
  ``memory`` (what the engine holds, its own report).

``<sampling>`` is keyword-only and the same everywhere: ``temperature=0.0`` (greedy),
``top_p=1.0``, ``top_k=0``, ``seed=None``, ``stop_token_ids=None`` (the tokenizer's EOS ids);
``max_tokens`` defaults to ``DEFAULT_MAX_TOKENS`` (``servecore.requests`` has every rule).
A request the engine refuses raises ``servecore.errors.InvalidRequest`` (a ``ValueError``)
naming its ``field``, ``value`` and ``reason`` before anything changed.

The multi-user contract behind these calls (interleaved streams, threads serialized, a round
at a time, ``close`` from any thread) is ``servecore.streams``'.

>>> from servecore.testing import FakeEngine
>>> engine = FakeEngine()
>>> engine.generate([[1], [2]], 2)
[[1, 8], [2, 9]]
>>> engine.add_request([3], 0)
Traceback (most recent call last):
...
servecore.errors.InvalidRequest: max_tokens=0 must be an int in [1, 2147483647]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from servecore.engine import EngineCore, Event
from servecore.prompts import Prompt
from servecore.requests import DEFAULT_MAX_TOKENS, GenerationRequest, RequestBuilder
from servecore.stats import ServingStats
from servecore.streams import Stream, Streams
from servecore.thread import daemon_thread

__all__ = ["EngineClient"]


class EngineClient:
    """The front door both engines subclass (see the module docstring).

    Args:
        core: the engine's core (``servecore.engine.EngineCore``).
        vocab_size: token ids lie in ``[0, vocab_size)``.
        tokenizer: optional; text and chat prompts need it, and ``generate(..., text=True)``.
        eos_ids: the default stop ids.
        check: the engine's own test that a request fits (its context, its pools):
            ``check(name, request)`` raises ``servecore.errors.InvalidRequest``.
        name: names the engine in errors (``EngineClosedError``).

    A subclass sets ``stats`` (a ``ServingStats``) and may override ``memory``.

    >>> from servecore.testing import FakeCore
    >>> class Tiny(EngineClient):
    ...     def __init__(self):
    ...         super().__init__(FakeCore(), vocab_size=32, name="Tiny")
    >>> with Tiny() as engine:
    ...     rid = engine.add_request([4], 2)
    ...     engine.step(), engine.step()
    ([(0, 4, False)], [(0, 11, True)])
    >>> engine.closed
    True
    """

    stats: ServingStats
    """Counters and rates over the engine's life (``servecore.ServingStats``; each engine's
    own subclass adds its own)."""

    def __init__(self, core: EngineCore, *, vocab_size: int, tokenizer: Any = None,
                 eos_ids: frozenset[int] = frozenset(),
                 check: Callable[[str, GenerationRequest], None] | None = None,
                 name: str = "the engine"):
        self.tokenizer = tokenizer
        self._streams = Streams(core, RequestBuilder(
            vocab_size=vocab_size, tokenizer=tokenizer, eos_ids=eos_ids, check=check),
            name=name)

    @property
    def vocab_size(self) -> int:
        """Token ids lie in ``[0, vocab_size)``."""
        return self._streams.build.vocab_size

    @property
    def eos_ids(self) -> frozenset[int]:
        """The ids that end a request unless it gives ``stop_token_ids``."""
        return self._streams.build.eos_ids

    def room_for(self, prompt_len: int) -> int | None:
        """The largest ``max_tokens`` a prompt of ``prompt_len`` tokens may ask for (at least
        0: a prompt that does not fit at all has none), or None when the engine sets no
        limit of its own (memory aside). A server's default ``max_tokens`` is cut to it.

        >>> from servecore.testing import FakeEngine
        >>> FakeEngine().room_for(100) is None
        True
        """
        return None

    def start_thread(self, target: Callable[[], Any], name: str) -> Any:
        """Start ``target()`` where a loop that drives this engine should run (the server's
        worker); something with ``is_alive()`` and ``join(timeout)``. Here a daemon thread of
        its own; an engine whose device work has a thread of its own runs it there
        (``mlxcache.Engine``: no hop between two threads per call).

        >>> from servecore.testing import FakeEngine
        >>> FakeEngine().start_thread(lambda: None, "loop").join()
        """
        return daemon_thread(target, name)

    @property
    def memory(self) -> Any:
        """What the engine holds for serving, part by part (each engine's report)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ requests ----

    def generate(self, prompts: Iterable[Prompt], max_tokens: Any = DEFAULT_MAX_TOKENS, *,
                 temperature: Any = 0.0, top_p: Any = 1.0, top_k: Any = 0, seed: Any = None,
                 stop_token_ids: Any = None, progress: bool = False, text: bool = False
                 ) -> list[list[int]] | list[str]:
        """The new tokens of every prompt (a stop token, when hit, is the last), or with
        ``text=True`` their text without the stop token that ended them. The arguments are
        ``stream``'s.

        >>> from servecore.testing import FakeEngine
        >>> FakeEngine().generate([[1, 2], [5]], [2, 3], seed=[0, 1])
        [[3, 10], [6, 13, 20]]
        """
        return self._streams.generate(
            prompts, max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, stop_token_ids=stop_token_ids, progress=progress, text=text)

    def stream(self, prompts: Iterable[Prompt], max_tokens: Any = DEFAULT_MAX_TOKENS, *,
               temperature: Any = 0.0, top_p: Any = 1.0, top_k: Any = 0, seed: Any = None,
               stop_token_ids: Any = None, progress: bool = False) -> Stream:
        """Serve ``prompts`` and yield ``(prompt index, token)`` as tokens are made.

        Args:
            prompts: a list (or any iterable, read once) of prompts, each token ids, text or
                a chat (``servecore.prompts``); one prompt alone is ``[prompt]``.
            max_tokens: tokens to generate, at least 1.
            temperature: 0 is greedy.
            top_p: nucleus filter mass (1.0 = off).
            top_k: top-k filter (0 = off).
            seed: per-request reproducible sampling (None: the engine's default stream).
            stop_token_ids: one id or a list that end a request (default: ``eos_ids``).
            progress: a tqdm bar of the tokens on stderr when it is a terminal.

        ``max_tokens`` and each sampling argument is one value for all prompts or a list (or
        1-D NumPy array) with one per prompt. Every request is checked before any is queued
        (``InvalidRequest`` names the bad value); iterating advances the engine; closing the
        stream (``close()``, leaving a ``with`` block, dropping it) aborts what is left.

        >>> from servecore.testing import FakeEngine
        >>> list(FakeEngine().stream([[1], [2]], 2))
        [(0, 1), (1, 2), (0, 8), (1, 9)]
        """
        return self._streams.stream(
            prompts, max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, stop_token_ids=stop_token_ids, progress=progress)

    def add_request(self, prompt: Prompt, max_tokens: Any = DEFAULT_MAX_TOKENS, *,
                    temperature: Any = 0.0, top_p: Any = 1.0, top_k: Any = 0,
                    seed: Any = None, stop_token_ids: Any = None, logprobs: Any = None) -> int:
        """Queue one request; its id. ``step`` (or ``step_events``) returns its tokens.
        ``logprobs=k`` (``0 <= k <= MAX_LOGPROBS``) makes each of its events carry the
        token's log-probability and the ``k`` most likely tokens'
        (``servecore.engine.TokenLogprobs``). The other arguments are ``stream``'s, for one
        prompt.

        >>> from servecore.testing import FakeEngine
        >>> engine = FakeEngine()
        >>> rid = engine.add_request([1, 2], 2, logprobs=1)
        >>> [(ev.token, ev.logprobs.top) for ev in engine.step_events()]
        [(3, ((3, -0.5),))]
        """
        return self._streams.add_request(
            prompt, max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop_token_ids=stop_token_ids, logprobs=logprobs)

    def step(self) -> list[tuple[int, int | None, bool]]:
        """One scheduling round; ``(request id, token, finished)`` of every token of the
        requests queued with ``add_request`` not returned yet (``token`` None: the request
        ended without one)."""
        return self._streams.step()

    def step_events(self) -> list[Event]:
        """``step``, as the core's ``servecore.engine.Event``\\ s: each token with how many
        prompt tokens the prefix cache served (on the first), its ``logprobs`` when asked
        for, and the error of a request a failed round dropped."""
        return self._streams.step_events()

    def abort(self, rid: int) -> bool:
        """End request ``rid`` (waiting or running; what it holds is freed at once); whether
        it was unfinished or had tokens not received yet."""
        return self._streams.abort(rid)

    def has_unfinished(self) -> bool:
        """Whether any request is queued, running or has tokens in flight."""
        return self._streams.has_unfinished()

    # ------------------------------------------------------------------- closing ----

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._streams.closed

    def close(self) -> None:
        """End the engine, from any thread, after the call under way: every request is
        dropped and what the core holds released; unfinished streams raise
        ``EngineClosedError`` once their tokens are read, and so does every later call.
        Idempotent."""
        self._streams.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ for subclasses ----

    def _serialized(self) -> Any:
        """The engine's lock, for a subclass's own work outside rounds (a cache reset,
        consistent stats); ``EngineClosedError`` once closed."""
        return self._streams.serialized()
