"""Committing a run's output, in named steps: read it off the device and check it
(``read_output``), cut out what finished since it was dispatched (``live_part``), split a
multi-step decode into its steps (``decode_run_steps``), and keep the stats
(``StatsClock``). ``hybridattn.engine._core`` calls them in that order; the scheduler's
``commit`` then records the tokens. (The token slots a run wrote are the ones the host named
when it launched it: nothing is read back for them.)

One prompt of two tokens, run whole (written to token slots 3 and 4; it sampled 7):

>>> r = Request(0, [5, 6], 4, row=1, row_slots=[3, 4])
>>> plan = StepPlan(Mode.EXTEND, ((r, [5, 6]),), (1, 2, 64, 2))
>>> run = Run(plan, None, np.array([7]), np.array(True), [[3, 4]], (1, 1, 2, 64, 2),
...           False, 0.0, 0.0, 0.0, 0.0)
>>> tokens, _ = read_output(run)
>>> live_part(run.plan, tokens, run.limits)[1]
array([7])
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from hybridattn.engine._runner import Run
from hybridattn.engine.plan import Mode, Request, StepPlan
from hybridattn.engine.stats import EngineStats
from hybridattn.sharding import to_host
from servecore.engine import TokenLogprobs

__all__ = ["StatsClock", "decode_run_steps", "live_part", "read_logprobs", "read_output"]


def read_output(run: Run) -> tuple[np.ndarray, float]:
    """Wait for ``run``'s tokens (``[B]``, ``[D][B]`` under a mesh, or ``[N, B]``) and check
    that no step ran out of token slots; returns them and the time they were read (the
    module docstring has an example).

    >>> plan = StepPlan(Mode.DECODE, ((Request(0, [5], 2, row=1, computed=1), [5]),),
    ...                 (1, 1, 64, 1))
    >>> read_output(Run(plan, None, np.array([7]), np.array(False), None, (), False,
    ...                 0.0, 0.0, 0.0, 0.0))
    Traceback (most recent call last):
    ...
    RuntimeError: a step refused the token slots or rows the host named (or ran out)
    """
    tokens = to_host(run.tokens)  # (across processes: every process reads every shard's)
    # read, not reduced on the device: a reduction would queue behind the next run
    ok = to_host(run.ok)
    now = time.perf_counter()
    if not ok.all():  # unreachable (the host's ids); only the sinks were written
        raise RuntimeError("a step refused the token slots or rows the host named (or ran "
                           "out)")
    return tokens, now


def read_logprobs(run: Run) -> dict[int, TokenLogprobs]:
    """The log-probabilities of a one-step ``run`` (read after ``read_output``), by request
    id, for each of its requests that asked for them (``Request.logprobs`` = k: the sampled
    token's and the k most likely); empty when none did.

    >>> r = Request(0, [5, 6], 4, row=1, logprobs=1)
    >>> plan = StepPlan(Mode.EXTEND, ((r, [5, 6]),), (1, 2, 64, 2))
    >>> lp = (np.array([-0.5]), np.array([[7, 3]]), np.array([[-0.5, -1.5]]))
    >>> read_logprobs(Run(plan, None, np.array([7]), np.array(True), [[3, 4]], (),
    ...                   False, 0.0, 0.0, 0.0, 0.0, logprobs=lp))
    {0: TokenLogprobs(logprob=-0.5, top=((7, -0.5),))}
    """
    if run.logprobs is None:
        return {}
    own, ids, top = (np.asarray(x) for x in run.logprobs)
    out = {}
    for j, (r, _) in enumerate(run.plan.work):
        if r.logprobs is not None:
            out[r.rid] = TokenLogprobs(float(own[j]), tuple(
                (int(i), float(v)) for i, v in zip(ids[j, : r.logprobs],
                                                   top[j, : r.logprobs], strict=True)))
    return out


def live_part(plan, tokens: np.ndarray, limits: list[int] | None):
    """``plan``, its tokens and step limits without the requests that finished since it was
    dispatched (aborted, or stopped in the run before it): ``(plan, tokens, limits)``.

    >>> a, b = Request(0, [5], 4, row=1, computed=1), Request(1, [6], 4, row=2, computed=1)
    >>> b.finish_reason = "abort"
    >>> plan = StepPlan(Mode.DECODE, ((a, [5]), (b, [6])), (2, 2, 64, 1))
    >>> p, toks, _ = live_part(plan, np.array([7, 8]), None)
    >>> [r.rid for r, _ in p.work], toks.tolist()
    ([0], [7])
    """
    if not isinstance(plan, StepPlan) or not any(r.finished for r, _ in plan.work):
        return plan, tokens, limits
    keep = [j for j, (r, _) in enumerate(plan.work) if not r.finished]
    plan = dataclasses.replace(
        plan, work=tuple(plan.work[j] for j in keep), ahead=(),
        restores=tuple(plan.restores[j] for j in keep) if plan.restores else (),
        snapshots=tuple(plan.snapshots[j] for j in keep) if plan.snapshots else ())
    return plan, tokens[..., keep], None if limits is None else [limits[j] for j in keep]


def one_step_plans(plan: StepPlan, steps: list[tuple[list[int], list[int]]]):
    """A multi-step decode's steps (``decode_run_steps``) as the one-step ``DECODE`` plans
    they ran, each with its tokens, in order (each computed after the one before it is
    committed: a request's next token is the one the step before sampled).

    >>> r = Request(0, [5], 4, row=1, computed=1, output=[6])  # 6 runs next
    >>> plan = StepPlan(Mode.DECODE, ((r, [6]),), (1, 1, 64, 1))
    >>> [(p.work[0][1], toks) for p, toks in one_step_plans(plan, [([0], [7])])]
    [([6], [7])]
    """
    reqs = [r for r, _ in plan.work]
    for idx, toks in steps:
        yield StepPlan(Mode.DECODE, tuple(
            (reqs[j], [reqs[j].token_at(reqs[j].computed)]) for j in idx), plan.buckets), toks


def decode_run_steps(plan: StepPlan, tokens: np.ndarray,
                     limits: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """A multi-step decode's ``tokens [N, B]`` as the single steps it ran: per step the
    indices in ``plan.work`` of the requests that ran it and their tokens, in order.
    Checked against the host's own finishing rule (each request runs until a stop token
    or its limit) before anything is committed; a disagreement raises ``RuntimeError``
    and changes nothing.

    >>> r = Request(0, [5], 4, stop_token_ids=frozenset({9}), row=1, computed=1)
    >>> plan = StepPlan(Mode.DECODE, ((r, [5]),), (1, 1, 64, 1))
    >>> decode_run_steps(plan, np.array([[7], [9], [-1]]), [3])  # stopped at its second step
    [([0], [7]), ([0], [9])]
    """
    runs = []
    for j, ((r, _), limit) in enumerate(zip(plan.work, limits, strict=True)):
        col = tokens[:, j].tolist()
        n = next((i for i, t in enumerate(col) if t < 0), len(col))
        ran = col[:n]
        stopped = [i for i, t in enumerate(ran) if t in r.stop_token_ids]
        if (any(t >= 0 for t in col[n:]) or (stopped and stopped[0] != n - 1)
                or not (n == limit or stopped)):
            raise RuntimeError(f"a multi-step decode ran request {r.rid} for {n} steps "
                               f"({ran}); the host expected a stop token in "
                               f"{sorted(r.stop_token_ids)} or {limit} steps")
        runs.append(ran)
    steps = []
    for i in range(max(map(len, runs), default=0)):
        idx = [j for j, ran in enumerate(runs) if i < len(ran)]
        steps.append((idx, [runs[j][i] for j in idx]))
    return steps


class StatsClock:
    """Keeps ``EngineStats`` of committed runs: when each run's outputs were ready (a run
    dispatched before the one before it was committed starts at that one's end), the
    compilations, tokens, seconds and host time.

    >>> clock = StatsClock(EngineStats())
    >>> clock.first_tokens([Request(0, [5, 6], 2, arrival=1.0)], ready=1.5)
    >>> clock.stats.requests, clock.stats.prompt_tokens, clock.stats.ttft
    (1, 2, [0.5])
    """

    def __init__(self, stats: EngineStats):
        self.stats = stats
        self.last_ready = 0.0  # when the last committed run's tokens were read

    def run_window(self, run: Run, now: float) -> tuple[float, float]:
        """``(start, ready)``: from when ``run`` ran to when its outputs were ready (now, or
        earlier if a round found them ready before); counts its bucket and compile time."""
        s = self.stats
        ready = now if run.ready_by is None else min(now, run.ready_by)
        start = max(run.t_pack, self.last_ready)  # a run dispatched early starts at the last
        self.last_ready = ready
        s.buckets.add(run.key)
        if run.compiled:  # this call compiled (the step, or the _follow of its bucket)
            # compiling is the dispatch's (synchronous) part, then its first run
            sec = (run.t_call - run.t_pack) + max(0.0, ready - max(run.t_call, start))
            if run.key not in s.bucket_compile_seconds:
                s.compiled_buckets.append(run.key)
            s.bucket_compile_seconds[run.key] = s.bucket_compile_seconds.get(run.key, 0.0) + sec
            s.compile_seconds += sec
        return start, ready

    def steps(self, run: Run, plan, num_steps: int, decode_tokens: int, start: float,
              ready: float) -> bool:
        """Count ``num_steps`` steps of ``plan`` (``decode_tokens`` tokens if it decodes) and
        their time; returns whether it ran prompt tokens (read before the commit advances the
        requests)."""
        s = self.stats
        s.steps += num_steps
        prefill = plan.prompt_tokens > 0
        if not prefill:
            s.decode_rounds += 1
        if prefill and not run.compiled:  # (a compiling run's time is the compile's)
            s.prefill_tokens += plan.prompt_tokens
            s.prefill_seconds += ready - start
        elif not run.compiled:
            s.decode_tokens += decode_tokens
            s.decode_seconds += ready - start
        return prefill

    def first_tokens(self, first: Sequence[Request], ready: float) -> None:
        """Requests that got their first token: prompt and cached tokens, time to it."""
        s = self.stats
        for r in first:
            s.requests += 1
            s.prompt_tokens += len(r.prompt)
            s.cached_tokens += r.start
            if s.shard_prompt_tokens:  # (under a mesh: one entry per data shard)
                s.shard_prompt_tokens[r.shard] += len(r.prompt)
                s.shard_cached_tokens[r.shard] += r.start
            s.add_ttft(ready - r.arrival)

    def host_time(self, run: Run, prefill: bool, t_wait: float, now: float,
                  covered: bool) -> None:
        """The host seconds of ``run`` (planning to dispatch, then the commit until now) and
        the wait for its outputs; ``covered``: the next run was still computing, hiding the
        commit."""
        if run.compiled:
            return
        s, done = self.stats, time.perf_counter()
        host = (run.t_call - run.t_plan) + (done - now)
        if prefill:
            s.prefill_host_seconds += host
            s.prefill_wait_seconds += now - t_wait
        else:
            s.decode_host_seconds += host
            s.decode_wait_seconds += now - t_wait
            s.decode_exposed_seconds += run.exposed + (0.0 if covered else done - now)
