"""The prefix policy of ``hybridattn.Engine`` over ``servecore.radix``: one module, one class.

``PrefixCache`` is what the scheduler asks about cached prefixes; it owns the radix tree
(token slots, with exact KDA state snapshots) and the snapshot slots, and queues the device
ops its decisions need (``FreeSlots`` of what it evicted, ``Borrow`` of what a row now reads
from the tree) on the scheduler's queue. The policy:

- Admission matches the prompt, locks the path, lets the row borrow the cached KV and
  restores the deepest snapshot on ``prompt[:-1]`` (the last prompt token always runs: its
  logits give the first sample); when the token slots are short it evicts exactly the
  shortfall of unlocked cached prefixes, then admits (or evicts nothing and waits when even
  an empty cache would not make room). That is ``servecore.prefix``, the policy of both
  engines (``match``, ``evict_shortfall``, ``take_states``, ``keep_state``); the device
  frees what the tree evicts (``FreeSlots``). A request that would restore a snapshot
  another prompt has planned but not taken yet waits for it.
- The prefill recomputes only the rest, snapshotting on the grid (``snapshot_points``).
  After each chunk that took snapshots (and when the whole prompt has run) the prompt so far
  goes into the tree with them, and the row borrows it from then on.
- When the request finishes, prompt and answer go in, ending at a snapshot of the end.

Where the snapshots are taken is ``servecore.snapshots`` (``mlxcache`` plans its own with the
same code):

>>> snapshot_points(prompt_len=300, kv_len=140, state_len=128, interval=64)
[140, 192, 256, 299]
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from hybridattn.engine.plan import Borrow, FreeSlots, Request, StepPlan
from servecore.ids import IdPool
from servecore.prefix import evict_shortfall, give_back, keep_state, match, take_states
from servecore.radix import Evicted, RadixCache
from servecore.requests import finish_after
from servecore.snapshots import snapshot_points

__all__ = ["PrefixCache", "snapshot_points"]

ReadSlots = Callable[[Request, int], Sequence[int]]


class DeviceFrees:
    """Token slots the tree gives back go to the device's allocator, as ``FreeSlots`` ops on
    the scheduler's queue (a ``servecore.prefix.SlotSink``: the device hands slots out).

    >>> ops = deque(); DeviceFrees(ops).give([4, 5]); ops
    deque([FreeSlots(slots=(4, 5))])
    """

    def __init__(self, device_ops: deque):
        self.device_ops = device_ops

    def give(self, slots: Sequence[int]) -> None:
        """Queue the freeing of ``slots``."""
        self.device_ops.append(FreeSlots(tuple(slots)))


class PrefixCache:
    """The radix tree and snapshot slots of one token pool, and the policy over them (see the
    module docstring). ``device_ops`` is the scheduler's queue of device ops.

    Its interface to the scheduler: ``admit`` / ``cancel`` / ``retire`` a request,
    ``read_ahead``, ``insert_prompt`` and ``insert_answer`` at a commit, ``released`` once a
    row's release has run, ``reset``; ``size`` and the counters ``snapshots_taken``,
    ``state_evictions``, ``token_evictions``.

    >>> from collections import deque
    >>> cache = PrefixCache(num_snapshot_slots=9, snapshot_interval=64, device_ops=deque())
    >>> req = Request(rid=0, prompt=[5, 6, 7], max_tokens=2)
    >>> cache.admit(req, running=[], room=16)  # nothing cached: borrow nothing, restore nothing
    ((), 0)
    >>> sorted(req.planned), cache.size  # a snapshot before the last prompt token
    ([2], 0)
    """


    def __init__(self, *, num_snapshot_slots: int, snapshot_interval: int,
                 device_ops: deque):
        self.tree = RadixCache(states=True)
        self.snapshot_slots = IdPool(num_snapshot_slots, "snapshot slot")
        self.snapshot_interval = snapshot_interval
        self.device_ops = device_ops
        self.frees = DeviceFrees(device_ops)
        self.snapshots_taken = self.state_evictions = self.token_evictions = 0

    @property
    def size(self) -> int:
        """Token slots the tree holds."""
        return self.tree.total_size

    # ------------------------------------------------------------------ admission ----

    def admit(self, req: Request, running: Sequence[Request],
              room: int) -> tuple[tuple[int, ...], int] | None:
        """Match ``req``'s prompt and plan its snapshots, with ``room`` token slots neither
        reserved nor cached (evicting to make room): the slots its row borrows and the depth
        it restores, or None (it waits; nothing changed). Sets ``req``'s prefix fields and
        ``owned`` (its reservation)."""
        if self._defer(req, running):
            return None
        tree, L = self.tree, len(req.prompt)
        m = match(tree, req.prompt)  # the last token runs: a state at most at L - 1
        tree.lock(m.node)
        P, S = len(m.slots), m.cached
        need = L - P + req.max_tokens - 1
        evicted = evict_shortfall(tree, room - tree.total_size, need)
        if evicted is None:  # even an empty cache would not make room: wait for running
            tree.unlock(m.node)  # requests, and keep the cache as it is
            return None
        self._evicted(evicted)
        points = snapshot_points(L, P, S, self.snapshot_interval)
        # The end of the request, one before the end of the prompt and the branch point may
        # evict older states for their slots (they serve the next turn, a repeat, a sibling);
        # grid points take free slots only, the deepest first.
        key = [p for p in dict.fromkeys((L - 1, P)) if p in points]  # P may be L - 1
        slots, evicted = take_states(tree, self.snapshot_slots, len(key) + 1, self.frees)
        self._evicted(evicted, given=True)
        req.finish_slot = slots.pop(0) if slots else 0
        grid = sorted((p for p in points if p not in key), reverse=True)
        slots += self.snapshot_slots.take(len(grid))
        req.planned = dict(zip(key + grid, slots, strict=False))
        req.node, req.borrowed, req.start = m.node, P, S
        req.restore = m.restore if m.restore is not None else 0
        req.owned = need
        return tuple(m.slots), S

    def _defer(self, req: Request, running: Sequence[Request]) -> bool:
        """Wait while a prompt still prefilling will put a snapshot (planned, not taken yet)
        on the part it shares with this prompt, deeper than what the tree gives now; taken
        snapshots go into the tree after each chunk."""
        have = self.tree.match_prefix(req.prompt[:-1]).state_node.depth
        for r in running:
            if not r.planned:
                continue
            n, limit = 0, min(len(req.prompt) - 1, len(r.prompt) - 1)
            while n < limit and req.prompt[n] == r.prompt[n]:
                n += 1
            if any(have < d <= n for d in r.planned):
                return True
        return False

    def _evicted(self, freed: Evicted, given: bool = False) -> None:
        """Count what the tree evicted and (unless ``given`` already) give it back: token
        slots through the device queue, snapshot slots to the free list."""
        if not given:
            give_back(freed, self.frees, self.snapshot_slots)
        self.token_evictions += len(freed.slots)
        self.state_evictions += len(freed.states)

    def reset(self) -> None:
        """Evict every cached prefix and snapshot no running request holds (the token slots
        are freed through ``device_ops``)."""
        self._evicted(self.tree.evict_states(self.tree.num_states))
        self._evicted(self.tree.evict(self.tree.total_size))

    def cancel(self, req: Request) -> None:
        """Undo ``admit``: the lock and the snapshot slots go back."""
        self.retire(req)
        req.borrowed, req.start, req.restore = 0, 0, 0

    def retire(self, req: Request) -> None:
        """``req`` finished (or was not admitted after all): its lock and the snapshot slots it
        will not fill go back."""
        if req.node is not None:
            self.tree.unlock(req.node)
            req.node = None
        slots = [*req.planned.values(), *req.taken.values()]
        if req.finish_slot and not req.end_depth:
            slots.append(req.finish_slot)
            req.finish_slot = 0
        if slots:
            self.snapshot_slots.give(slots)
        req.planned, req.taken = {}, {}

    # ------------------------------------------------------------------- commits ----

    def read_ahead(self, plan: StepPlan, tokens: Sequence[int], read_slots: ReadSlots,
                   ) -> ReadSlots:
        """The row slots a commit of ``plan`` will need (requests whose prompt goes into the
        tree now, and requests that finish), read up front; returns a reader of that copy."""
        rows = {}
        for i, ((r, toks), tok) in enumerate(zip(plan.work, tokens, strict=False)):
            after = r.computed + len(toks)
            took = bool(plan.snapshots and plan.snapshots[i])
            inserts = r.prefilling and (took or after >= len(r.prompt))
            samples = after >= len(r.prompt) and not r.finished
            finishes = samples and finish_after(len(r.output) + 1, int(tok), r) is not None
            if inserts or finishes:
                rows[r.rid] = list(read_slots(r, after))
        return lambda r, n: rows[r.rid][:n]

    def insert_prompt(self, r: Request, read_slots: ReadSlots) -> int:
        """The prompt tokens computed so far go into the tree with the snapshots taken on
        them (after a chunk that took snapshots, so requests waiting for them can start, and
        once the whole prompt is in), and the row borrows them from then on (a device op
        frees the row's duplicates). Returns the token slots the request no longer owns (the
        tree holds them now)."""
        tree, n = self.tree, r.computed
        if n < r.borrowed:
            # A chunk that ended inside the KV the row borrows (recomputed from a shallower
            # snapshot, e.g. after the deeper states were evicted): those tokens are in the
            # tree already and the row keeps borrowing (and locking) all of them; only the
            # states it took are new. Shrinking the borrow here would hand the tree's slots
            # past n to the row, which would free them at its release.
            self._add_taken_states(r)
            return 0
        tokens = r.prompt[:n]
        tree.insert(tokens, list(read_slots(r, n)))
        m = tree.match_prefix(tokens)
        tree.lock(m.node)
        tree.unlock(r.node)
        r.node, r.prompt_slots = m.node, list(m.slots)
        r.inserted = not r.prefilling
        self._add_taken_states(r)
        self.device_ops.append(Borrow(r, tuple(r.prompt_slots)))
        handed = n - r.borrowed
        r.owned -= handed
        r.borrowed = n
        return handed

    def _add_taken_states(self, r: Request) -> None:
        """The snapshots ``r`` took go into the tree, at depths its prompt path reaches."""
        for d, s in sorted(r.taken.items()):  # given back: a concurrent request put one first
            self.snapshots_taken += keep_state(self.tree, r.prompt[:d], s, self.snapshot_slots)
        r.taken = {}

    def insert_answer(self, r: Request, read_slots: ReadSlots) -> None:
        """A finished request: prompt and the answer tokens that ran go into the tree, the row
        hands the answer's new slots over (``keep_from``), and its release snapshots the end."""
        L, F = len(r.prompt), len(r.prompt) + len(r.output) - 1
        ran = r.tokens[:F]
        slots = r.prompt_slots + list(read_slots(r, F))[L:]
        r.keep_from = self.tree.insert(ran, slots)
        if r.finish_slot:
            r.end_depth = F

    def released(self, r: Request) -> None:
        """``r``'s row was released, its end snapshot written: it goes into the tree."""
        if r.end_depth:  # given back: the tree has a state there already, or evicted the path
            self.snapshots_taken += keep_state(self.tree, r.tokens[: r.end_depth],
                                               r.finish_slot, self.snapshot_slots)
            r.finish_slot, r.end_depth = 0, 0
