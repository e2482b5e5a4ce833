"""What every generation route does, whichever API it speaks: ``Ask`` (what the client asked
for, parsed) and ``pieces`` (the engine's answer as text, piece by piece).

A call's choices are its prompts x ``n``: choice ``p * n + i`` is the ``i``-th answer to prompt
``p``. The first answer of each prompt is submitted at once; its siblings are submitted when
it has its first token, so they find the whole prompt in the prefix cache and compute only
their own tokens. A sibling's seed is ``seed + i`` (the same seed gives the same choices; two
choices of one call differ).

``pieces`` yields lists: everything that arrived since the last one (one wake-up of the event
loop, one write to the client). In them, ``ACCEPTED`` once the engine has taken the first
answers (a refusal, such as a prompt longer than the context, raises ``APIError`` before: a
streaming route can still answer with an error status), ``KEEPALIVE`` (alone) when nothing
happened for ``keepalive`` seconds (a long prefill), and a ``Piece`` per token's worth of text.
When the consumer stops early (the client left, an error) every request still running is
cancelled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from servecore.engine import Event
from servecore.server._errors import APIError
from servecore.server._text import TextStream
from servecore.server._worker import EngineWorker, Generation

__all__ = ["ACCEPTED", "KEEPALIVE", "Ask", "Piece", "Usage", "pieces"]

ACCEPTED = "accepted"
KEEPALIVE = "keepalive"


@dataclasses.dataclass
class Ask:
    """One call's generation: its prompts (token ids), ``n`` answers each, and how to sample
    and stop (``stop``: strings matched on the text).

    >>> Ask([[1, 2]], n=2, max_tokens=4).num_choices
    2
    """

    prompts: list[list[int]]
    n: int = 1
    max_tokens: int = 16
    max_tokens_given: bool = True  # False: the server's default, cut to what fits the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    prompt_field: str = "prompt"  # what the API calls the prompt ("messages" in a chat)
    logprobs: int | None = None  # None, or k: each token's log-probability and k others'

    @property
    def num_choices(self) -> int:
        """Answers in all."""
        return len(self.prompts) * self.n


class Piece(NamedTuple):
    """Text of choice ``index`` (maybe empty) and, on its last piece, why it ended (``"stop"``:
    an EOS token or a stop string; ``"length"``: ``max_tokens``).

    >>> Piece(0, " w5", "stop", stop="w6").finish_reason
    'stop'
    """

    index: int
    text: str
    finish_reason: str | None = None
    stop: str | None = None  # the stop string that ended it
    # with Ask.logprobs: (token id, servecore.engine.TokenLogprobs) of each token it brings
    logprobs: tuple = ()


@dataclasses.dataclass
class Usage:
    """Token counts of one call: every prompt once, every generated token, and the prompt
    tokens the prefix cache served (each prompt's first answer says).

    >>> Usage(prompt_tokens=10, completion_tokens=4, cached_tokens=8).total_tokens
    14
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None  # seconds to the call's first token

    @property
    def total_tokens(self) -> int:
        """Prompt and completion tokens."""
        return self.prompt_tokens + self.completion_tokens


async def pieces(worker: EngineWorker, ask: Ask, tokenizer: Any, eos: frozenset[int],
                 usage: Usage, keepalive: float = 10.0) -> AsyncIterator[Any]:
    """The answer of ``ask`` (see the module docstring); ``usage`` is filled as it goes.
    ``servecore.testing.FakeCore`` answers prompt ``[17]`` with 17, 24, 31:

    >>> from servecore.testing import FakeEngine, word_tokenizer
    >>> worker = EngineWorker(FakeEngine())
    >>> worker.start()
    >>> async def answer():
    ...     usage = Usage()
    ...     out = [p async for batch in pieces(worker, Ask([[17]], max_tokens=3),
    ...                                        word_tokenizer(32), frozenset(), usage)
    ...            for p in batch]
    ...     return out, usage.completion_tokens
    >>> out, tokens = asyncio.run(answer())
    >>> tokens, out[0], [(p.text, p.finish_reason) for p in out[1:]]
    (3, 'accepted', [('w17', None), (' w24', None), (' w31', 'length')])
    >>> worker.stop()
    """
    gen = Generation(asyncio.get_running_loop(), ask.num_choices, ask.prompt_field)
    texts = [TextStream(tokenizer, ask.stop) for _ in range(ask.num_choices)]
    counts = [0] * ask.num_choices
    open_ = set(range(ask.num_choices))
    submitted: set[int] = set()
    usage.prompt_tokens = sum(len(p) for p in ask.prompts)
    limits = [ask.max_tokens] * ask.num_choices  # each choice's max_tokens, as submitted

    def submit(choice: int) -> None:
        prompt, i = divmod(choice, ask.n)
        seed = None if ask.seed is None else (ask.seed + i) % 2**31
        if not ask.max_tokens_given:  # the default: what fits (a prompt too long still fails)
            room = worker.engine.room_for(len(ask.prompts[prompt]))
            limits[choice] = max(1, min(ask.max_tokens, ask.max_tokens if room is None
                                        else room))
        worker.submit(gen, choice, ask.prompts[prompt], limits[choice],
                      temperature=ask.temperature, top_p=ask.top_p, top_k=ask.top_k, seed=seed,
                      logprobs=ask.logprobs)
        submitted.add(choice)

    worker.reserve(ask.num_choices)  # every answer counts against the queue's limit
    try:
        for p in range(len(ask.prompts)):
            submit(p * ask.n)
        accepted = 0
        while open_:
            batch = []
            if gen.queue.empty():
                try:  # (not wait_for: on 3.11 it can swallow the cancel of a client that left)
                    async with asyncio.timeout(keepalive):
                        batch.append(await gen.queue.get())
                except TimeoutError:
                    yield [KEEPALIVE]
                    continue
            while not gen.queue.empty():  # all that arrived, in one batch
                batch.append(gen.queue.get_nowait())
            out = []
            for choice, item in batch:
                if choice not in open_:  # ended (a stop string) while its tokens came
                    continue
                if isinstance(item, APIError):
                    raise item
                if isinstance(item, int):  # accepted
                    accepted += 1
                    if accepted == len(ask.prompts):
                        out.append(ACCEPTED)
                    continue
                piece = _take(item, choice, texts[choice], counts, limits[choice], eos, worker,
                              gen)
                if item.token is not None and counts[choice] == 1:
                    _first(item, choice, ask, usage, gen, submit)
                if piece.finish_reason is not None:
                    open_.discard(choice)
                out.append(piece)
            if out:
                yield out
    finally:
        usage.completion_tokens = sum(counts)
        worker.release(ask.num_choices - len(submitted))  # siblings that never went
        if open_:
            worker.cancel(gen)


def _first(ev: Event, choice: int, ask: Ask, usage: Usage, gen: Generation, submit) -> None:
    """Choice ``choice`` has its first token: the cache's share of its prompt (each prompt's
    first answer), the call's time to first token, and its siblings' turn."""
    if gen.first_at is None:
        gen.first_at = time.perf_counter()
        usage.ttft = gen.first_at - gen.submitted_at
    if choice % ask.n == 0:
        usage.cached_tokens += ev.cached or 0
        for i in range(1, ask.n):
            submit(choice + i)


def _take(ev: Event, choice: int, text: TextStream, counts: list[int], limit: int,
          eos: frozenset[int], worker: EngineWorker, gen: Generation) -> Piece:
    """One engine event of ``choice`` (asked for ``limit`` tokens) as a ``Piece``."""
    if ev.token is None:  # ended without a token (cancelled elsewhere)
        return Piece(choice, text.finish(), "stop")
    counts[choice] += 1
    if ev.finished and ev.token in eos:  # the EOS token is not part of the answer
        return Piece(choice, text.finish(), "stop")
    piece = text.add(ev.token)
    if text.stopped:  # the token that completed a stop string is not part of it either
        if not ev.finished:
            worker.cancel_choice(gen, choice)
        return Piece(choice, piece, "stop", text.matched)
    lp = ((ev.token, ev.logprobs),) if ev.logprobs is not None else ()
    if ev.finished:
        return Piece(choice, piece + text.finish(),
                     "length" if counts[choice] >= limit else "stop", logprobs=lp)
    return Piece(choice, piece, logprobs=lp)
