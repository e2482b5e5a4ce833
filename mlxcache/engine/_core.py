"""The engine's core (``servecore.engine.EngineCore``): requests by id, one round at a time.

A request's life (prefix reuse on):

1. *admit* (``mlxcache.engine._admission``): the longest cached prefix is matched and locked;
   slots for the tokens the tree lacks are allocated, evicting least recently used unlocked
   prefixes if the pool is short. (A full hit runs its last token again, for its logits, but
   needs no slot: that token's K/V is in the tree already.) If even that fails while other
   requests run, the request waits for them to finish. While requests wait, prefill batches
   run back to back, before the next decode step (prefill first).
2. *prefill*: each row starts from its prefix gathered from the pool; only the new tokens run
   through the model, all rows in one forward (one long prompt alone, in chunks). The new K/V
   are written to the pool at the new slots, each prompt is inserted into the radix tree
   (duplicate slots, when another request inserted the same tokens first, are freed) and each
   request's lock moves to its whole prompt.
3. *decode*: the request joins the running batch (a row of every layer's decode cache); all
   running requests advance one token per forward, each with its own sampling parameters.
   The next step is queued before the host reads this step's tokens (``mx.async_eval``).
   Rows whose request asked for ``logprobs`` get them computed from the same logits
   (``mlxcache.logprobs``), scheduled with the tokens and reported with them; a batch where
   none asks computes none.
4. *finish* (``servecore.requests.finish_reason``): the K/V of the generated tokens are
   written to the pool and prompt + answer are inserted, so a follow-up turn reuses them; the
   lock is released.

Where requests meet the model is a *path*, chosen once from ``Support``: ``PooledPath`` (the
engine's caches, batched or one request per forward) or ``PlainPath`` (mlx-lm's caches).

A round that fails drops what it was serving (a failed prefill its batch; a failed decode
step every running request, whose decode caches may be half-updated), reports each as
``Event(rid, None, True, error)``, rebuilds the allocators and the tree's locks from what
survives (so no slot is leaked or both free and cached, no lock is left behind) and raises.

Examples:
    >>> from mlxcache.engine.options import check_options
    >>> from mlxcache.engine.stats import EngineStats
    >>> from mlxcache.engine.support import Support
    >>> from mlxcache.zoo import make_model
    >>> from servecore.requests import RequestBuilder
    >>> model = make_model()
    >>> core = Core(model, Support.probe(model), check_options(num_slots=32), EngineStats())
    >>> core.submit(0, RequestBuilder(vocab_size=64).one([1, 2, 3], 2))
    >>> events = []
    >>> while core.has_work():
    ...     _ = core.run_round(events.append)
    >>> [(e.rid, e.finished) for e in events]
    [(0, False), (0, True)]
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcache.engine._admission import AdmissionPolicy
from mlxcache.engine._disk import DiskTier
from mlxcache.engine._forward import arrays_in
from mlxcache.engine._job import LIVE, Group, Job
from mlxcache.engine._path_plain import PlainPath
from mlxcache.engine._path_pooled import PooledPath
from mlxcache.engine._store import PrefixStore
from mlxcache.engine.memory import working_budget, working_bytes
from mlxcache.engine.options import EngineOptions
from mlxcache.engine.stats import EngineStats
from mlxcache.engine.support import Support
from mlxcache.layers import leaves
from mlxcache.logprobs import LogprobBatch, logprob_arrays
from mlxcache.pool import POOL_NAME, PoolExhausted
from mlxcache.sampling import next_key, sample
from servecore.diskcache import DiskStore
from servecore.engine import Event
from servecore.requests import GenerationRequest

__all__ = ["Core"]


class Core:
    """The core of ``mlxcache.Engine`` (see the module docstring): ``submit``, ``cancel``,
    ``run_round``, ``has_work``. ``store`` (built with reuse) holds the pools and the tree.

    >>> from mlxcache.engine import Engine
    >>> from mlxcache.zoo import make_model
    >>> core = Engine(make_model(), prefix_cache=False).core
    >>> core.store is None, type(core.path).__name__, core.has_work()
    (True, 'PooledPath', False)
    """

    def __init__(self, model: nn.Module, support: Support, opts: EngineOptions, stats: EngineStats):
        self.model = model
        self.support = support
        self.stats = stats
        self.prefill_step_size = opts.prefill_step_size
        self.store = PrefixStore.build(support, opts, stats) if support.reuse else None
        self.path = (PooledPath(model, support, self.store, opts.page_size)
                     if support.supported else PlainPath(model))
        self.working = working_budget(support, opts, self.store, lambda: self.path.groups)
        self.admission = AdmissionPolicy(opts, self.store, support.batched, self.working)
        self.peak_working_bytes = 0  # the most the decode buffers held after a round
        self.jobs: dict[int, Job] = {}
        self.disk: DiskTier | None = None  # attach_disk: the disk tier under the store
        self._emit: Callable[[Event], None] | None = None
        self._pending: deque[Event] = deque()  # jobs dropped outside a round, to report

    # ------------------------------------------------------------ EngineCore ----

    def submit(self, rid: int, request: GenerationRequest) -> None:
        """Queue ``request``; its sampling key is made (and evaluated) in the caller's thread."""
        seed = request.sampling.seed
        key = None if seed is None else mx.random.key(seed)
        mx.eval(arrays_in([key]))  # evaluated: any thread may use it
        job = Job(rid, request, key, arrival=time.perf_counter())
        self.jobs[rid] = job
        self.admission.push(job)

    def cancel(self, rid: int) -> bool:
        """Drop job ``rid`` (waiting or running), freeing what it holds; whether it was live."""
        job = self.jobs.pop(rid, None)
        if job is None or job.state not in LIVE:
            return False
        try:
            if job.state == "waiting":
                self.admission.waiting.remove(job)
                job.state = "cancelled"
            elif job.state == "reloading":
                self.disk.drop(job)
                job.state = "cancelled"
            else:
                self._finish(job, job.group, publish=False, state="cancelled")
            self._settle()
        except BaseException as e:  # removing a row failed half-way: the caches are suspect
            self._abort(e, [job], groups=True)
            raise
        return True

    def has_work(self) -> bool:
        """Whether any job waits or runs, or a dropped one is still to be reported."""
        return bool(self._pending or self.admission.waiting or self._num_running()
                    or (self.disk is not None and self.disk.pending))

    def run_round(self, emit: Callable[[Event], None]) -> bool:
        """One round: admit and prefill a batch if one fits, then one decode step of every
        group (prefill first: not while admissible requests still wait). False if there was
        nothing to do."""
        reported = bool(self._pending)
        while self._pending:
            emit(self._pending.popleft())
        self._emit = emit
        try:
            return self._round() or reported
        finally:
            self._emit = None
            self.peak_working_bytes = max(self.peak_working_bytes,
                                          working_bytes(self.path.groups))

    def close(self) -> None:
        """Drop every request and the pools (``Engine.close``): ``store`` (the KV and state
        pools, the tree) and ``path`` (the running batch's decode caches) become None, and
        MLX's buffer cache is emptied, after the work already scheduled ends. Idempotent."""
        if self.path is None:
            return
        if self.disk is not None:
            try:
                self.disk.close(flush=self.flush_on_close)
            finally:
                self.disk = None
        mx.synchronize()
        self.jobs.clear()
        self.admission.waiting.clear()
        self._pending.clear()
        self.store = self.admission.store = None
        self.path = None
        mx.clear_cache()

    # ---------------------------------------------------------------- rounds ----

    def attach_disk(self, disk: DiskStore, salt_key: str, flush_on_close: bool = True) -> None:
        """Put the disk tier ``disk`` (its pages keyed under ``salt_key``) under the store:
        evicted prefixes spill to it, and prompts that reach past memory reload from it
        (``mlxcache.engine._disk``); ``close`` spills what memory holds (``flush_on_close``)."""
        if self.store is None:
            raise ValueError("a disk tier needs the prefix cache (prefix_cache=True and a "
                             "model the engine reuses prefixes of)")
        self.disk = DiskTier(self.store, disk, salt_key, self.stats)
        self.flush_on_close = flush_on_close
        self.stats.disk = disk.stats

    def _round(self) -> bool:
        reloading = False  # a round that waits on the disk tier is work too
        if self.disk is not None:
            try:
                reloading = self._reloads()
            except BaseException as e:
                self._abort(e, [r.job for r in self.disk.pending], groups=False)
                raise
        prefilled = self._admit_and_prefill()
        if prefilled and self.admission.waiting:  # prefill first: more may be admissible now
            self._settle()  # the reader may take its first token to another thread
            return True
        decoded = False
        for group in list(self.path.groups):
            if group.jobs:
                decoded = True
                try:
                    self._decode_step(group)
                except BaseException as e:
                    self._abort(e, [], groups=True)
                    raise
        self._settle()
        return prefilled or decoded or reloading

    def _reloads(self) -> bool:
        """Requests whose pages were read back rejoin the queue at its head; each new one
        whose prompt reaches past memory into the disk tier waits for its pages. Whether any
        reload is under way or ended."""
        disk = self.disk
        for job in list(self.admission.waiting):
            if not job.disk_checked:
                job.disk_checked = True
                if disk.plan(job):
                    self.admission.waiting.remove(job)
        # nothing else to do: wait here (a read started above ends in this round, not the next)
        if disk.pending and not self.admission.waiting and not self._num_running():
            wait([r.future for r in disk.pending], timeout=0.05, return_when=FIRST_COMPLETED)
        for job in reversed(disk.ready()):
            if self.jobs.get(job.rid) is job:
                self.admission.waiting.appendleft(job)
        return bool(disk.pending)

    def _admit_and_prefill(self) -> bool:
        batch: list[Job] = []
        try:
            self.admission.admit(batch, self._num_running())
            if not batch:
                if self.admission.waiting and not self._num_running():
                    # Unreachable while every prompt fits the pool (checked at the door):
                    # with nothing running nothing is locked, so all slots are free or
                    # evictable. Drop the request rather than retry it forever.
                    job, store = self.admission.waiting[0], self.store
                    need = len(job.tokens) - len(store.tree.match_prefix(job.tokens).slots)
                    err = PoolExhausted(need, store.num_free_slots + store.tree.evictable_size,
                                        what=POOL_NAME)
                    self._abort(err, [job], groups=False)
                    raise err
                return False
            caches = self._prefill(batch)
        except BaseException as e:
            self._abort(e, batch, groups=False)
            raise
        try:
            for row, job in enumerate(batch):
                self._report(job, job.output[-1])
                if job.done:
                    self._finish(job, None)
                else:
                    job.group, job.state = self.path.join(job, caches, row), "running"
                    self._page_states(job.group, [job.group.jobs.index(job)])
        except BaseException as e:  # a half-joined row: the running batch's caches are suspect
            self._abort(e, batch, groups=True)
            raise
        return True

    def _prefill(self, jobs: list[Job]) -> list[Any]:
        """Run the jobs' uncached tokens; sample each first token; publish the prompts.

        Returns the per-layer caches, row ``i`` holding job ``i``'s prompt.
        """
        tic = time.perf_counter()
        todo = [j.tokens[j.cached :] for j in jobs]
        caches = self.path.prefill_caches(jobs)
        # All but the last token first, evaluating only the caches, so the LM head runs for
        # one position per request (as in mlx-lm's generators); then the last tokens. The
        # first part runs in forwards of at most prefill_step_size tokens per row, each row
        # stopping at its next snapshot point (hybrid models), right-padded to the longest.
        pos = [j.cached for j in jobs]
        ends = [len(j.tokens) - 1 for j in jobs]
        points = [[d for d in j.points if d > j.cached] for j in jobs]
        snaps: list[tuple[int, int, int]] = []  # (job, depth, snapshot slot)
        while True:
            stop = self.path.cut([min(end, p + self.prefill_step_size, *pts[:1])
                                  for p, end, pts in zip(pos, ends, points, strict=True)], pos)
            rows = [j.tokens[p:t] for j, p, t in zip(jobs, pos, stop, strict=True)]
            width = max(map(len, rows))
            if width == 0:
                break
            self.path.forward(caches, rows, width)
            taken = [i for i, (t, pts) in enumerate(zip(stop, points, strict=True))
                     if pts and pts[0] == t]
            for i in taken:
                points[i].pop(0)
            if taken:
                snaps += self.store.snapshot(caches, taken, [stop[i] for i in taken])
            # Each chunk is evaluated before the next is built (bounded memory, as mlx-lm's
            # prefill); the last one only scheduled, so building the last tokens' forward
            # overlaps its compute.
            (mx.async_eval if stop == ends else mx.eval)(
                arrays_in([c.state for c in leaves(caches)]), self._state_arrays())
            pos = stop
        last = self.model(mx.array([t[-1:] for t in todo]), cache=caches)[:, -1, :]
        tokens, logprobs = self._sample(jobs, last)
        mx.eval(tokens, logprobs.arrays() if logprobs else [],
                arrays_in([c.state for c in leaves(caches)]))
        self._hold_logprobs(jobs, logprobs)
        for job, token in zip(jobs, tokens.tolist(), strict=True):
            job.output.append(token)
        if self.store is not None:
            self.store.publish_prompts(jobs, caches, snaps)
        toc = time.perf_counter()
        s = self.stats
        s.requests += len(jobs)
        s.prompt_tokens += sum(len(j.tokens) for j in jobs)
        s.cached_tokens += sum(j.cached for j in jobs)
        s.prefill_tokens += sum(map(len, todo))
        s.prefill_seconds += toc - tic
        for j in jobs:
            s.add_ttft(toc - j.arrival)
        return caches

    def _decode_step(self, group: Group) -> None:
        """One forward for the group; reports the tokens sampled by the *previous* step.

        The step's own samples stay on the device (``mx.async_eval``) and feed the next step,
        so building the next graph overlaps this step's compute, as in mlx-lm's generators.
        A request that finishes costs one wasted row of one step.
        """
        tic = time.perf_counter()
        feed, unread = group.feed, group.unread
        logits = self.model(feed[:, None], cache=group.caches)[:, -1, :]
        self._page_states(group, range(len(group.jobs)))
        jobs = list(group.jobs)
        group.feed, logprobs = self._sample(jobs, logits)
        group.unread = [True] * len(jobs)
        mx.async_eval(group.feed, logprobs.arrays() if logprobs else [])
        fed = feed.tolist()
        self.stats.decode_seconds += time.perf_counter() - tic
        finished = []
        for job, token, new in zip(jobs, fed, unread, strict=True):
            if new:
                job.output.append(token)
                self.stats.decode_tokens += 1
                self._report(job, token)  # with the logprobs held by the previous step
                if job.done:
                    finished.append(job)
        self._hold_logprobs(jobs, logprobs)  # this step's, reported with its tokens next
        # Last rows first: a finished row at the end leaves without moving another row.
        for job in sorted(finished, key=group.jobs.index, reverse=True):
            self._finish(job, group)

    def _page_states(self, group: Group, rows: Iterable[int]) -> None:
        """Hybrid models with pages of several tokens: each of ``rows`` that ends on a page
        boundary keeps its state there (``PrefixStore.page_state``), for its answer."""
        store = self.store
        if store is not None and store.has_states and store.page_size > 1:
            for row in rows:
                store.page_state(group.jobs[row], group.caches, row)

    def _sample(self, jobs: list[Job], logits: mx.array) -> tuple[mx.array,
                                                                  LogprobBatch | None]:
        """Each job's next token, and the log-probabilities of the jobs that ask for them
        (None when none does: nothing is computed)."""
        keys = []
        for j in jobs:
            if j.key is not None and not j.request.sampling.greedy:
                j.key, use = next_key(j.key)
                keys.append(use)
            else:
                keys.append(None)
        tokens = sample(logits, [j.request.sampling for j in jobs], keys)
        return tokens, logprob_arrays(logits, tokens, [j.request.logprobs for j in jobs])

    @staticmethod
    def _hold_logprobs(jobs: list[Job], logprobs: LogprobBatch | None) -> None:
        """Each job that asked keeps its row of ``logprobs`` until its token is reported."""
        if logprobs is not None:
            for row, job in enumerate(jobs):
                if job.request.logprobs is not None:
                    job.held_logprobs = (logprobs, row)

    def _finish(self, job: Job, group: Group | None, publish: bool = True,
                state: str = "done") -> None:
        """Cache prompt + answer (when there is room and ``publish``), leave the group, drop
        the lock."""
        if group is not None:
            row = group.jobs.index(job)
            if self.store is not None and publish:
                self.store.publish_answer(job, group.caches, row)
            self.path.leave(group, row)
        if self.store is not None:
            self.store.drop_page_state(job)  # kept for an answer not published
            self.store.unlock(job.node)
        job.node, job.state, job.group = None, state, None
        self.jobs.pop(job.rid, None)

    # ---------------------------------------------------------------- events ----

    def _report(self, job: Job, token: int) -> None:
        # the first token says how many prompt tokens the prefix cache served; a job that
        # asked for logprobs gets those its token was sampled with
        held, job.held_logprobs = job.held_logprobs, None
        self._emit(Event(job.rid, token, job.done,
                         cached=job.cached if len(job.output) == 1 else None,
                         logprobs=held[0].read(held[1]) if held is not None else None))

    def _dropped(self, job: Job, error: BaseException) -> None:
        """Report ``job`` dropped by ``error`` (now inside a round, else at the next one)."""
        job.state, job.group = "aborted", None
        self.jobs.pop(job.rid, None)
        event = Event(job.rid, None, True, error)
        if self._emit is not None:
            self._emit(event)
        else:
            self._pending.append(event)

    # --------------------------------------------------------------- failure ----

    def _abort(self, exc: BaseException, jobs: list[Job], groups: bool) -> None:
        """After an exception inside a round: drop ``jobs`` and, with ``groups``, every running
        job (their decode caches may be half-updated), then rebuild the allocators and the
        tree's locks from what survives, so that wherever the exception struck, no slot is
        leaked, none is both free and cached, and no lock is left behind."""
        dropped = list(jobs)
        if groups:
            dropped += [j for g in self.path.groups for j in g.jobs]
            self.path.new_groups()
        for job in dropped:
            if job.state not in LIVE:
                continue
            if job.state == "waiting":
                self.admission.waiting.remove(job)
            elif job.state == "reloading":
                self.disk.drop(job)
            self._dropped(job, exc)
        for job in self.admission.waiting:  # a waiting job holds nothing (an admission may
            job.forget_prefix()  # have been cut short)
        if self.store is not None:
            running = [j for g in self.path.groups for j in g.jobs]
            if not self.store.reconcile(running):  # a running prefix was lost from the tree
                lost = RuntimeError("mlxcache: a running prefix was lost")
                for job in running:
                    job.node = None
                    self._dropped(job, lost)
                self.path.new_groups()
        self._settle()

    # ---------------------------------------------------------------- arrays ----

    def _num_running(self) -> int:
        return sum(len(g.jobs) for g in self.path.groups)

    def _state_arrays(self) -> list[mx.array]:
        store = self.store
        return arrays_in([store.states.arrays]) if store and store.states is not None else []

    def _settle(self) -> None:
        """Schedule every array the engine keeps between calls (``mx.async_eval``: no wait, so
        the decode pipelining stays). MLX (>= 0.31.2) ties an array that is not yet scheduled
        to the stream of the thread that built it, and another thread evaluating it fails
        ("There is no Stream(cpu, N) in current thread"); a scheduled one any thread may wait
        on. So the next call gets only scheduled arrays, whichever thread makes it. (The pool
        is scheduled after each write already.)"""
        mx.async_eval(arrays_in([a for g in self.path.groups for a in g.arrays()]))
