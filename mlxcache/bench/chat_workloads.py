"""The server benchmark's workloads as data: chat conversations in the word tokenizer's
language (the word ``wN`` is token ``N``; ``zoo.VOCAB`` words), built from fixed seeds.

A ``Workload`` is phases run one after another; a phase is sessions run concurrently; a
session is ``Step``s run in order. A step's request is the session's history followed by
its own messages; a step with ``keep`` makes those messages and the answer the history of
the next step (a multi-turn chat), otherwise the history stays as it was (a regeneration
or an edit sends a fixed transcript). The three workloads:

(a) ``shared_system``: users behind one long system prompt, each with a short message of
    their own, arriving in concurrent waves (waves of 4: 16 connections at once make
    ``mlx_lm.server``, whose ``socketserver`` listen backlog is 5, drop some of them);
(b) ``multi_turn``: sessions of several turns, each turn the previous prompt, its answer and
    a new message; the sessions run concurrently, their turns in order;
(c) ``regen_edit``: conversations (a system prompt and a few finished turns) sent, then
    re-sent unchanged (a regeneration), then with the last user message changed (edits).

>>> w = shared_system(users=4, waves=2, system_words=8, user_words=2)
>>> [len(phase) for phase in w.phases], w.requests
([2, 2], 4)
>>> w.phases[0][0][0].messages[1]["role"], len(w.phases[0][0][0].messages[0]["content"].split())
('user', 8)
"""

from __future__ import annotations

import dataclasses
import random

from mlxcache.zoo import VOCAB
from servecore.testing import FIRST_WORD

__all__ = ["Step", "Workload", "all_workloads", "multi_turn", "regen_edit", "shared_system",
           "words"]

Message = dict[str, str]


@dataclasses.dataclass(frozen=True)
class Step:
    """One request of a session: ``messages`` after the session's history; ``keep``: the
    messages and the answer extend that history."""

    messages: tuple[Message, ...]
    keep: bool = False


@dataclasses.dataclass(frozen=True)
class Workload:
    """``phases`` in order, each a tuple of sessions run concurrently, each a tuple of
    ``Step``s in order; ``max_tokens`` for every answer."""

    key: str
    title: str
    phases: tuple[tuple[tuple[Step, ...], ...], ...]
    max_tokens: int

    @property
    def requests(self) -> int:
        """How many requests the workload sends."""
        return sum(len(session) for phase in self.phases for session in phase)


def words(rng: random.Random, n: int) -> str:
    """``n`` random words of the word tokenizer (``n`` tokens), no special tokens.

    >>> words(random.Random(0), 3)
    'w114 w55 w103'
    """
    return " ".join(f"w{rng.randrange(FIRST_WORD, VOCAB)}" for _ in range(n))


def _msg(role: str, content: str) -> Message:
    return {"role": role, "content": content}


def shared_system(users: int = 16, waves: int = 4, system_words: int = 1024,
                  user_words: int = 16, max_tokens: int = 8, seed: int = 1) -> Workload:
    """(a) ``users`` requests behind one system prompt of ``system_words`` words, each with a
    message of ``user_words`` words, in ``waves`` concurrent waves."""
    rng = random.Random(seed)
    system = _msg("system", words(rng, system_words))
    steps = [Step((system, _msg("user", words(rng, user_words)))) for _ in range(users)]
    per = -(-users // waves)
    phases = tuple(tuple((s,) for s in steps[i:i + per]) for i in range(0, users, per))
    return Workload("shared_system",
                    f"(a) {users} users, one {system_words}-word system prompt, "
                    f"{len(phases)} waves", phases, max_tokens)


def multi_turn(sessions: int = 8, turns: int = 5, system_words: int = 64,
               user_words: int = 32, max_tokens: int = 16, seed: int = 2) -> Workload:
    """(b) ``sessions`` concurrent chats of ``turns`` turns, each session its own system
    prompt of ``system_words`` words, each turn a ``user_words``-word message."""
    rng = random.Random(seed)
    chats = []
    for _ in range(sessions):
        first = Step((_msg("system", words(rng, system_words)),
                      _msg("user", words(rng, user_words))), keep=True)
        rest = [Step((_msg("user", words(rng, user_words)),), keep=True)
                for _ in range(turns - 1)]
        chats.append((first, *rest))
    return Workload("multi_turn", f"(b) {sessions} sessions x {turns} turns",
                    (tuple(chats),), max_tokens)


def regen_edit(conversations: int = 4, system_words: int = 256, history_turns: int = 3,
               user_words: int = 32, answer_words: int = 16, regenerations: int = 1,
               edits: int = 2, max_tokens: int = 8, seed: int = 3) -> Workload:
    """(c) ``conversations`` concurrent transcripts (a system prompt, ``history_turns``
    finished turns, a last user message), each sent, then re-sent ``regenerations`` times,
    then sent with its last message replaced ``edits`` times, in that order."""
    rng = random.Random(seed)
    convs = []
    for _ in range(conversations):
        head = [_msg("system", words(rng, system_words))]
        for _ in range(history_turns):
            head += [_msg("user", words(rng, user_words)),
                     _msg("assistant", words(rng, answer_words))]
        last = _msg("user", words(rng, user_words))
        sent = [Step((*head, last))] * (1 + regenerations)
        sent += [Step((*head, _msg("user", words(rng, user_words)))) for _ in range(edits)]
        convs.append(tuple(sent))
    return Workload("regen_edit",
                    f"(c) {conversations} conversations: sent, {regenerations} regeneration"
                    f"{'s' * (regenerations != 1)}, {edits} edits",
                    (tuple(convs),), max_tokens)


def all_workloads(quick: bool = False, seed: int = 0) -> list[Workload]:
    """The three workloads at full size, or (``quick``) a smoke run's; another ``seed``
    gives other words (a repeat that no cache has seen).

    >>> [w.requests for w in all_workloads()], [w.requests for w in all_workloads(True)]
    ([16, 40, 16], [4, 4, 6])
    """
    if quick:
        return [shared_system(users=4, waves=2, system_words=128, user_words=8, seed=seed + 1),
                multi_turn(sessions=2, turns=2, system_words=16, user_words=16, max_tokens=8,
                           seed=seed + 2),
                regen_edit(conversations=2, system_words=64, history_turns=1, edits=1,
                           seed=seed + 3)]
    return [shared_system(seed=seed + 1), multi_turn(seed=seed + 2), regen_edit(seed=seed + 3)]
