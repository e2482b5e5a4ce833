"""mlxcache returns log-probabilities (``logprobs=k``) exactly as mlx-lm computes them.

The oracle is mlx-lm's own ``generate_step`` on the same tiny model (``mlxcache.zoo``), one
request alone with the model's ``make_prompt_cache``: each step yields the token and its
``logprobs`` vector (``logits - logsumexp``, before any sampling). A sampled request's tokens
are replayed through ``generate_step`` (a sampler that returns them), so its vectors are those
of the raw distribution at the same positions. Each event's logprob and top-k must match the
vector within ``TOL``; a top-k id may differ from the oracle's only where two values are that
close (a near-tie, which float rounding may order either way).
"""

from __future__ import annotations

import itertools
import random

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx_lm.generate import generate_step  # noqa: E402

from mlxcache import zoo  # noqa: E402
from mlxcache.engine import Engine, ReuseDisabledWarning  # noqa: E402
from mlxcache.logprobs import logprob_arrays  # noqa: E402

pytestmark = pytest.mark.mlx

TOL = 1e-4
HYBRID = {"qwen3_next"}
MAX = 5
_MODELS: dict[str, object] = {}


def model_of(family: str):
    if family not in _MODELS:
        _MODELS[family] = zoo.make(family)
    return _MODELS[family]


def engine(family: str) -> Engine:
    if family == "llama4":  # a cache kind the pool does not know: the plain path, no reuse
        with pytest.warns(ReuseDisabledWarning):
            return Engine(model_of(family), max_batch_size=8)
    hybrid = dict(num_snapshots=48, snapshot_interval=8) if family in HYBRID else {}
    return Engine(model_of(family), num_slots=512, max_batch_size=8, **hybrid)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, zoo.VOCAB) for _ in range(n)]


def oracle(family: str, prompt: list[int], n: int, replay: list[int] | None = None):
    """mlx-lm's (token, logprobs vector) for ``n`` steps: greedy, or ``replay``'s tokens."""
    it = itertools.chain(replay or [], itertools.repeat(0))  # it samples a step ahead
    sampler = None if replay is None else (lambda lp: mx.array([next(it)]))
    steps = generate_step(mx.array(prompt), model_of(family), max_tokens=n, sampler=sampler)
    return [(tok, lp.astype(mx.float32)) for tok, lp in steps]


def run(e: Engine, requests: list[dict]) -> list[list]:
    """Each request's events, served together (``add_request`` keywords)."""
    rids = [e.add_request(**r) for r in requests]
    events: dict[int, list] = {rid: [] for rid in rids}
    while not all(ev and ev[-1].finished for ev in events.values()):
        for ev in e.step_events():
            assert ev.error is None, ev.error
            events[ev.rid].append(ev)
    return [events[rid] for rid in rids]


def check(events, want, k: int) -> None:
    """The events' tokens and logprobs against the oracle's steps ``want``."""
    assert [ev.token for ev in events] == [tok for tok, _ in want]
    for step, (ev, (tok, vec)) in enumerate(zip(events, want, strict=True)):
        lp = ev.logprobs
        assert lp is not None, step
        assert abs(lp.logprob - vec[tok].item()) < TOL, (step, lp.logprob, vec[tok].item())
        assert len(lp.top) == k, step
        best = mx.sort(vec)[::-1][:k].tolist()
        ids = [i for i, _ in lp.top]
        assert len(set(ids)) == k, (step, ids)
        for (i, v), b in zip(lp.top, best, strict=True):
            # the j-th value is the oracle's j-th, and the id has that value there (an id
            # may differ from the oracle's argsort only at a near-tie)
            assert abs(v - b) < TOL and abs(vec[i].item() - v) < TOL, (step, i, v, b)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@pytest.mark.parametrize("family", ["llama", "qwen3_next", "gemma3_text", "llama4"])
def test_greedy_logprobs_match_mlx_lm(family):
    """Pooled attention-only, hybrid, sliding-window and the plain path (llama4)."""
    p = tokens(1, 21)
    (events,) = run(engine(family), [dict(prompt=p, max_tokens=MAX, logprobs=5)])
    check(events, oracle(family, p, MAX), 5)


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_a_batch_mixing_requests_with_and_without_logprobs(family):
    """Rows without logprobs get None and the same tokens; rows with them (k = 0 and
    k = 20, the most) match the oracle, whatever shares their batch."""
    e = engine(family)
    prompts = [tokens(s, n) for s, n in ((2, 9), (3, 23), (4, 14), (5, 30))]
    ks = [None, 0, None, 20]
    got = run(e, [dict(prompt=p, max_tokens=MAX, logprobs=k)
                  for p, k in zip(prompts, ks, strict=True)])
    for p, k, events in zip(prompts, ks, got, strict=True):
        if k is None:
            assert [ev.logprobs for ev in events] == [None] * MAX
            assert [ev.token for ev in events] == zoo.reference_generate(model_of(family), p, MAX)
        else:
            check(events, oracle(family, p, MAX), k)


@pytest.mark.parametrize("family", ["llama", "qwen3_next", "gemma3_text"])
def test_a_prefix_cache_hit_returns_the_same_logprobs(family):
    """A request whose prefix is cached (and one served entirely from the cache, which runs
    its last token again) gets the logprobs a cold run gets."""
    e = engine(family)
    shared = tokens(6, 20)
    run(e, [dict(prompt=shared + tokens(7, 4), max_tokens=MAX)])
    p = shared + tokens(8, 5)
    (events,) = run(e, [dict(prompt=p, max_tokens=MAX, logprobs=3)])
    assert events[0].cached >= 16
    check(events, oracle(family, p, MAX), 3)
    (again,) = run(e, [dict(prompt=p, max_tokens=MAX, logprobs=3)])
    assert again[0].cached == len(p) - 1
    check(again, oracle(family, p, MAX), 3)


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_sampled_requests_get_the_raw_distributions_logprobs(family):
    """temperature, top-k and top-p change the token drawn, not the logprobs reported: those
    of the model's raw distribution at each position (the oracle replays the tokens)."""
    e = engine(family)
    p = tokens(9, 17)
    reqs = [dict(prompt=p, max_tokens=MAX, logprobs=4, temperature=1.5, seed=s, top_k=k,
                 top_p=q) for s, k, q in ((1, 0, 1.0), (2, 3, 1.0), (3, 0, 0.8))]
    for events in run(e, reqs):
        drawn = [ev.token for ev in events]
        check(events, oracle(family, p, MAX, replay=drawn), 4)


def test_ties_go_to_the_lower_id():
    """Within the top-k and at its edge (the k-th and the next tied), most likely first,
    ties to the lower id; k = 0 lists none."""
    logits = mx.array([[0.0, 1.0, 3.0, 1.0, 3.0, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    batch = logprob_arrays(logits, mx.array([5, 3]), [3, 0])
    mx.eval(batch.arrays())
    assert [i for i, _ in batch.read(0).top] == [2, 4, 1]
    assert batch.read(1).top == () and abs(batch.read(1).logprob + 1.791759) < 1e-5
    flat = logprob_arrays(logits[1:], mx.array([0]), [4])
    mx.eval(flat.arrays())
    assert [i for i, _ in flat.read(0).top] == [0, 1, 2, 3]
