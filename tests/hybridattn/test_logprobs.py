"""Log-probabilities from ``hybridattn.Engine`` (``GenerationRequest.logprobs``), checked
against the cache-free model: ``kimi_linear.apply`` over each prompt + its generated tokens,
the log-softmax of its float32 logits at each generated position. Greedy and sampled
requests, chunked prompts, a batch mixing requests with and without logprobs (whose tokens
do not change), a prefix-cache hit and a multi-step-decode engine."""

from __future__ import annotations

from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import CFG, PARAMS, engine, prompts_of

from hybridattn.models import kimi_linear as M

TOL = 1e-4  # absolute, on log-probabilities
WIDTH = 96  # the engines' max_context_len: one compilation of the oracle
_apply = jax.jit(lambda p, ids: jax.nn.log_softmax(M.apply(p, CFG, ids).astype(jnp.float32)))

# (prompt length, max_tokens, sampling, logprobs); every step of a request with logprobs
# here has one with k in 2..5 beside it, so each of them returns 5 (one compilation a shape)
SPECS = [
    (20, 8, dict(), 5),
    (9, 4, dict(temperature=0.9, top_k=12, seed=3), 0),
    (70, 6, dict(), 3),  # a chunked prompt (chunked_prefill_size=64)
    (14, 8, dict(), None),
    (11, 8, dict(temperature=1.0, top_p=0.8, seed=5), None),
    (30, 8, dict(temperature=0.7, seed=7), 2),
]


def run(eng, prompts, specs):
    """Every request through ``step_events``: per request its events, in order."""
    rids = [eng.add_request(p, n, logprobs=k, **kw)
            for p, (_, n, kw, k) in zip(prompts, specs, strict=True)]
    got = defaultdict(list)
    while eng.has_unfinished():
        for ev in eng.step_events():
            assert ev.token is not None and ev.error is None
            got[ev.rid].append(ev)
    return [got[r] for r in rids]


def oracle(prompts, outputs) -> list[np.ndarray]:
    """Per request ``[n, V]``: the log-probabilities ``apply`` gives each generated position."""
    ids = np.zeros((len(prompts), WIDTH), np.int32)  # right padding: causal, so harmless
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        s = p + o[:-1]
        ids[i, : len(s)] = s
    logp = np.asarray(_apply(PARAMS, jnp.asarray(ids)))
    return [logp[i, len(p) - 1: len(p) - 1 + len(o)]
            for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))]


def check(events, want: np.ndarray, k: int | None, greedy: bool) -> None:
    """One request's events against its oracle rows."""
    for ev, row in zip(events, want, strict=True):
        if k is None:
            assert ev.logprobs is None
            continue
        lp = ev.logprobs
        assert abs(lp.logprob - row[ev.token]) < TOL, (lp.logprob, row[ev.token])
        if greedy:  # the sampled token is the most likely (up to a near-tie)
            assert row.max() - row[ev.token] < TOL
        assert len(lp.top) == k
        order = np.argsort(-row, kind="stable")[:k]
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        for (i, v), j in zip(lp.top, order, strict=True):
            assert abs(v - row[j]) < TOL and abs(v - row[i]) < TOL
            assert i == j or abs(row[i] - row[j]) < TOL  # ids swap at near-ties only


@pytest.fixture(scope="module")
def first():
    """One engine (overlapped, prefix cache) serving ``SPECS`` at once, and its events."""
    eng = engine()
    prompts = prompts_of([n for n, *_ in SPECS], seed=21)
    return eng, prompts, run(eng, prompts, SPECS)


def test_logprobs_agree_with_apply(first):
    _, prompts, events = first
    outputs = [[ev.token for ev in evs] for evs in events]
    assert [len(o) for o in outputs] == [n for _, n, _, _ in SPECS]
    for evs, want, (_, _, kw, k) in zip(events, oracle(prompts, outputs), SPECS, strict=True):
        check(evs, want, k, greedy=not kw.get("temperature"))


def test_logprobs_leave_the_tokens_alone(first):
    """The same requests with no logprobs at all (the plain step throughout) sample the same
    tokens, and their events carry none."""
    _, prompts, events = first
    plain = run(engine(), prompts, [(n, m, kw, None) for n, m, kw, _ in SPECS])
    assert [[e.token for e in evs] for evs in plain] == \
        [[e.token for e in evs] for evs in events]
    assert all(e.logprobs is None for evs in plain for e in evs)


def test_logprobs_after_a_prefix_cache_hit(first):
    """A follow-up turn of a served request: its prompt comes mostly from the cache, and the
    step that runs the rest returns the same log-probabilities as the model."""
    eng, prompts, events = first
    turn = prompts[0] + [e.token for e in events[0]] + [3, 1, 4]
    spec = (len(turn), 6, dict(), 20)  # the largest k
    [evs] = run(eng, [turn], [spec])
    assert evs[0].cached > 0
    [want] = oracle([turn], [[e.token for e in evs]])
    check(evs, want, 20, greedy=True)


def test_logprobs_with_multi_step_decode():
    """``decode_steps=4``: rounds with a request that wants logprobs decode one step at a
    time (and get them right); the others' tokens are those of an engine serving no
    logprobs, and once no request wants them the engine decodes several steps a dispatch."""
    specs = [(12, 10, dict(), 2), (17, 16, dict(temperature=0.8, seed=1), None),
             (8, 6, dict(temperature=0.8, seed=2), 1)]
    prompts = prompts_of([n for n, *_ in specs], seed=5)
    eng = engine(decode_steps=4)
    events = run(eng, prompts, specs)
    outputs = [[ev.token for ev in evs] for evs in events]
    for evs, want, (_, _, kw, k) in zip(events, oracle(prompts, outputs), specs, strict=True):
        check(evs, want, k, greedy=not kw.get("temperature"))
    plain = run(engine(decode_steps=4), prompts, [(n, m, kw, None) for n, m, kw, _ in specs])
    assert [[e.token for e in evs] for evs in plain] == outputs
    assert eng.core.runner.jit._decode  # the last tokens came from multi-step decodes
