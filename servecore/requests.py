"""One request builder for both engines: the argument names, their checks, the finishing rule.

Every engine takes a request the same way (``generate``, ``stream``, ``add_request``):

* ``prompts``: a list of prompts, each token ids, text or a chat (``servecore.prompts``);
* ``max_tokens``: tokens to generate per request, at least 1 (default ``DEFAULT_MAX_TOKENS``);
* ``temperature``, ``top_p``, ``top_k``, ``seed``: ``servecore.sampling.SamplingParams``;
  ``seed=None`` (the default) samples from the engine's default stream; one seed is each
  request's own seed, so identical prompts with one seed sample alike (give a list of seeds,
  one per prompt, for different samples);
* ``stop_token_ids``: one id or a list; a request ends on any of them (the stop token is kept
  in its output); default: the tokenizer's (and config's) EOS ids;
* ``logprobs``: None (the default), or ``k`` in ``[0, MAX_LOGPROBS]``: each of the request's
  tokens comes with its log-probability and the ``k`` most likely tokens' (``Event.logprobs``,
  a ``servecore.engine.TokenLogprobs``).

``max_tokens`` and each sampling argument is one value for every prompt, or a list (or 1-D
NumPy array) with one per prompt. All of it is checked before anything is queued: a
``ValueError`` names the bad value and the prompt it belongs to, and then nothing has changed.

A request has finished when its output reached ``max_tokens`` or ends with a stop token
(``finish_reason``; ``finish_after`` when only the output's length and last token are at hand,
as in ``hybridattn``'s scheduler, whose requests carry ``max_tokens`` and ``stop`` alike).

>>> build = RequestBuilder(vocab_size=16, eos_ids=frozenset({1}))
>>> [r.max_tokens for r in build([[3, 4], [5]], [2, 3])]
[2, 3]
>>> r = build.one([3, 4], 4, temperature=0.5, seed=7)
>>> r.tokens, r.sampling.seed, sorted(r.stop)
([3, 4], 7, [1])
>>> finish_reason([9, 1], r), finish_reason([9, 9, 9, 9], r), finish_reason([9], r)
('stop', 'length', None)
>>> build([[3], [4]], 2, top_p=[1.0, 0.0])
Traceback (most recent call last):
...
servecore.errors.InvalidRequest: prompt 1: top_p=0.0 must be in (0, 1]
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from servecore.errors import InvalidRequest
from servecore.prompts import encode_prompt
from servecore.sampling import SamplingParams
from servecore.validate import check_int, prompt_list, stop_ids

__all__ = ["DEFAULT_MAX_TOKENS", "MAX_LOGPROBS", "GenerationRequest", "RequestBuilder",
           "finish_after", "finish_reason", "per_prompt"]

DEFAULT_MAX_TOKENS = 256
"""``max_tokens`` when a call does not give it."""

MAX_LOGPROBS = 20
"""The most alternatives a token's ``logprobs`` may list (OpenAI's limit)."""


@dataclasses.dataclass(frozen=True, eq=False)
class GenerationRequest:
    """One validated request: what to continue, how far, how to sample, when to stop.

    >>> r = GenerationRequest([1, 2], 3, SamplingParams(), frozenset({0}))
    >>> r.max_tokens, r.context_len  # the context it needs: the prompt and all but the last
    (3, 4)
    """

    tokens: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: frozenset[int]
    # None: no log-probabilities; k: each token's and its k most likely alternatives'
    logprobs: int | None = None

    @property
    def context_len(self) -> int:
        """Positions the request occupies at most: its prompt and every generated token but
        the last (which is returned, never fed back)."""
        return len(self.tokens) + self.max_tokens - 1


def finish_reason(output: Sequence[int], request: GenerationRequest) -> str | None:
    """``"stop"`` when ``output`` ends with one of the request's stop tokens, ``"length"`` when
    it holds ``max_tokens`` tokens, else ``None`` (still running). The rule of both engines.

    >>> r = GenerationRequest([1], 2, SamplingParams(), frozenset({7}))
    >>> finish_reason([], r), finish_reason([7], r), finish_reason([3, 4], r)
    (None, 'stop', 'length')
    """
    return finish_after(len(output), output[-1] if output else None, request)


def finish_after(count: int, last: int | None, request: GenerationRequest) -> str | None:
    """``finish_reason`` of an output of ``count`` tokens that ends with ``last`` (None: no
    output yet), without the output itself: a stop token first, then the length. ``request``
    is anything with ``max_tokens`` and ``stop``.

    >>> r = GenerationRequest([1], 2, SamplingParams(), frozenset({7}))
    >>> [finish_after(n, last, r) for n, last in [(1, 7), (2, 7), (2, 3), (0, None)]]
    ['stop', 'stop', 'length', None]
    """
    if count and last in request.stop:
        return "stop"
    if count >= request.max_tokens:
        return "length"
    return None


def per_prompt(name: str, value: Any, n: int) -> list[Any]:
    """``value`` for each of ``n`` prompts: a list, tuple or 1-D NumPy array must have one entry
    per prompt; anything else is shared by all.

    >>> per_prompt("seed", 3, 2), per_prompt("seed", [3, None], 2)
    ([3, 3], [3, None])
    >>> per_prompt("top_k", [1, 2, 3], 2)
    Traceback (most recent call last):
    ...
    ValueError: top_k has 3 entries for 2 prompts
    """
    if _listed(value):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def _listed(value: Any) -> bool:
    return isinstance(value, list | tuple) or isinstance(value, np.ndarray) and value.ndim == 1


class RequestBuilder:
    """Turns an engine call's arguments into ``GenerationRequest``s (see the module docstring).

    ``tokenizer`` (optional) encodes text and chats; ``vocab_size`` bounds token ids;
    ``eos_ids`` are the default stop ids; ``check(name, request)`` is the engine's own test
    that a request fits (its context, its pool): it raises ``ValueError`` naming ``name``.

    >>> def fits(name, r):
    ...     if r.context_len > 8:
    ...         raise ValueError(f"{name} needs {r.context_len} positions, more than 8")
    >>> RequestBuilder(vocab_size=16, check=fits)([[1, 2], [3] * 8], 2)
    Traceback (most recent call last):
    ...
    servecore.errors.InvalidRequest: prompt 1 needs 9 positions, more than 8
    """

    def __init__(self, *, vocab_size: int, tokenizer: Any = None,
                 eos_ids: frozenset[int] = frozenset(),
                 check: Callable[[str, GenerationRequest], None] | None = None):
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self._check = check

    def stop(self, stop_token_ids: Any) -> frozenset[int]:
        """The stop ids a call asks for (``None``: the default EOS ids), checked.

        >>> sorted(RequestBuilder(vocab_size=8, eos_ids=frozenset({2})).stop(None))
        [2]
        """
        if stop_token_ids is None:
            return self.eos_ids
        with _field("stop_token_ids", stop_token_ids):
            return stop_ids(stop_token_ids, self.vocab_size)

    def __call__(self, prompts: Any, max_tokens: Any = DEFAULT_MAX_TOKENS, *,
                 temperature: Any = 0.0, top_p: Any = 1.0, top_k: Any = 0, seed: Any = None,
                 stop_token_ids: Any = None, logprobs: Any = None) -> list[GenerationRequest]:
        """One request per prompt (a list of prompts, read once), every value checked before
        any is returned; a bad one is an ``InvalidRequest`` naming it."""
        with _field("prompts", None):
            prompts = prompt_list(prompts)
        n = len(prompts)
        given = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        columns = {}
        for name, value in dict(given, max_tokens=max_tokens, logprobs=logprobs).items():
            with _field(name, value):
                columns[name] = per_prompt(name, value, n)
        listed = any(map(_listed, (max_tokens, logprobs, *given.values())))
        stop = self.stop(stop_token_ids)
        out = []
        for i, prompt in enumerate(prompts):
            where = f"prompt {i}"
            with _field(None, None, where if listed else ""):
                sampling = _sampling({name: columns[name][i] for name in given})
                limit = _max_tokens(columns["max_tokens"][i])
                top = _logprobs(columns["logprobs"][i])
            out.append(self._make(where, prompt, limit, sampling, stop, top))
        return out

    def one(self, prompt: Any, max_tokens: Any = DEFAULT_MAX_TOKENS, *, temperature: Any = 0.0,
            top_p: Any = 1.0, top_k: Any = 0, seed: Any = None,
            stop_token_ids: Any = None, logprobs: Any = None) -> GenerationRequest:
        """One request (``add_request``): the same checks, the prompt named ``prompt``.

        >>> RequestBuilder(vocab_size=16).one([3], 2, logprobs=5).logprobs
        5
        >>> RequestBuilder(vocab_size=16).one([3], 2, logprobs=21)
        Traceback (most recent call last):
        ...
        servecore.errors.InvalidRequest: logprobs=21 must be None or an int in [0, 20]
        """
        sampling = _sampling(dict(temperature=temperature, top_p=top_p, top_k=top_k,
                                  seed=seed))
        return self._make("prompt", prompt, _max_tokens(max_tokens), sampling,
                          self.stop(stop_token_ids), _logprobs(logprobs))

    def _make(self, name: str, prompt: Any, max_tokens: int, sampling: SamplingParams,
              stop: frozenset[int], logprobs: int | None = None) -> GenerationRequest:
        with _field("prompt", None):
            tokens = encode_prompt(name, prompt, self.tokenizer, self.vocab_size)
        req = GenerationRequest(tokens, max_tokens, sampling, stop, logprobs)
        if self._check is not None:
            with _field("prompt", len(tokens)):
                self._check(name, req)
        return req


@contextlib.contextmanager
def _field(name: str | None, value: Any, where: str = "") -> Iterator[None]:
    """A ``ValueError`` inside becomes an ``InvalidRequest`` of field ``name`` (one already
    typed keeps its field); ``where`` (``"prompt 2"``) starts the message."""
    try:
        yield
    except InvalidRequest as e:
        if not where:
            raise
        raise InvalidRequest(f"{where}: {e.reason}", field=e.field, value=e.value) from None
    except ValueError as e:
        reason = f"{where}: {e}" if where else str(e)
        raise InvalidRequest(reason, field=name or "prompt", value=value) from None


def _sampling(values: dict[str, Any]) -> SamplingParams:
    """``SamplingParams(**values)``; a bad value is an ``InvalidRequest`` naming its field."""
    try:
        return SamplingParams(**values)
    except ValueError as e:
        for name, value in values.items():  # the field at fault: each alone
            with _field(name, value):
                SamplingParams(**{name: value})
        raise InvalidRequest(str(e), field="sampling", value=values) from None


def _max_tokens(value: Any) -> int:
    with _field("max_tokens", value):
        return check_int("max_tokens", value, 1)


def _logprobs(value: Any) -> int | None:
    """``logprobs`` checked: None, or an int in ``[0, MAX_LOGPROBS]``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer) \
            or not 0 <= value <= MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs={value!r} must be None or an int in [0, "
                             f"{MAX_LOGPROBS}]", field="logprobs", value=value)
    return int(value)
