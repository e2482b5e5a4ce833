"""The host's token slots: ``TokenSlots`` owns the engine's free list of MLA token slots and
chooses each step's, so the device takes exactly those (the batch's ``token_slots``) and
nothing is copied back or mirrored.

A request's slots are its row's (``Request.row_slots``, position by position): those it
borrows from the prefix cache, then one per position a step ran or was dispatched to run,
recorded when the step is packed. A slot chosen for a step that a request does not run (it
stopped in the run before, or inside a multi-step decode) stays on its list until its row is
released, which gives back everything past what ran (the device never took those).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridattn.engine.plan import Request, StepPlan

__all__ = ["TokenSlots"]


class TokenSlots:
    """The free token slots ``1 .. capacity`` (slot 0 is the sink) and, per request row, how
    many leading positions the device's row borrows (written to the sink when recomputed).

    >>> from hybridattn.engine.plan import Mode
    >>> pool = TokenSlots(capacity=8, max_running_requests=2)
    >>> r = Request(0, [5, 6, 7], 3, row=1)
    >>> pool.admitted(r, 1, borrowed=())
    >>> plan = StepPlan(Mode.EXTEND, ((r, [5, 6, 7]),), (1, 3, 64, 3))
    >>> pool.take(plan)
    [[1, 2, 3]]
    >>> pool.undo(); r.row_slots, pool.num_free  # as if never taken
    ([], 8)
    >>> pool.take(plan)
    [[1, 2, 3]]
    >>> r.row_slots, pool.num_free
    ([1, 2, 3], 5)
    >>> r.computed = 3
    >>> pool.released(r); pool.num_free
    8
    """

    def __init__(self, capacity: int, max_running_requests: int):
        self.free = list(range(capacity, 0, -1))  # pops from the end: 1 first
        self.borrowed = [0] * (max_running_requests + 1)  # per row, as the device's pool
        self._last: list[tuple[Request, int]] = []  # the last take: (request, slots it got)

    @property
    def num_free(self) -> int:
        """Token slots neither a request nor the prefix cache holds."""
        return len(self.free)

    def admitted(self, req: Request, row: int, borrowed: Sequence[int]) -> None:
        """``req`` has row ``row``; the row borrows the cache's slots ``borrowed``."""
        req.row_slots = list(borrowed)
        self.borrowed[row] = len(borrowed)

    def _extend(self, req: Request, at: int, n: int) -> list[int]:
        """Slots for ``req``'s positions ``at .. at + n - 1`` (0 below what its row borrows,
        which the step writes to the sink), recorded in its ``row_slots``."""
        have, lo = req.row_slots, min(max(at, self.borrowed[req.row]), at + n)
        k = at + n - lo  # fresh positions lo .. at + n - 1; below lo the row borrows
        if k and lo != len(have):  # cannot happen: positions are planned in order
            raise RuntimeError(f"request {req.rid}: a slot for position {lo} but its row "
                               f"holds {len(have)}")
        if k > len(self.free):  # cannot happen: admission reserved the request's life
            raise RuntimeError("token slots ran out despite the reservation")
        got = self.free[len(self.free) - k:][::-1]  # popped from the end, in order
        del self.free[len(self.free) - k:]
        have.extend(got)
        return [0] * (lo - at) + got

    def take(self, plan: StepPlan, limits: Sequence[int] | None = None):
        """Choose the slots of ``plan``'s tokens: per work item a list (one step), or with
        ``limits`` (a multi-step decode) ``[N, B]`` (``N = max(limits)`` rows of the plan's
        ``B``): item ``j`` runs up to ``limits[j]`` steps from its position."""
        ahead = plan.ahead or (0,) * len(plan.work)
        self._last = [(r, len(r.row_slots)) for r, _ in plan.work]
        if limits is None:
            return [self._extend(r, r.computed + a, len(toks))
                    for (r, toks), a in zip(plan.work, ahead, strict=True)]
        table = np.zeros((max(limits), plan.buckets[0]), np.int32)
        for j, ((r, _), a, n) in enumerate(zip(plan.work, ahead, limits, strict=True)):
            table[:n, j] = self._extend(r, r.computed + a, n)
        return table

    def undo(self) -> None:
        """Give back what the last ``take`` chose (its step was never dispatched: packing
        or the dispatch raised)."""
        for r, n in reversed(self._last):
            self.free.extend(reversed(r.row_slots[n:]))
            del r.row_slots[n:]
        self._last = []

    def borrow(self, req: Request, slots: Sequence[int]) -> None:
        """``req``'s row borrows the cache's ``slots`` for its first positions: its own slots
        there that differ are free again (as ``serving.borrow_prefix`` frees them)."""
        have, n = req.row_slots, len(slots)
        for p in range(self.borrowed[req.row], min(n, len(have))):
            if have[p] > 0 and have[p] != slots[p]:
                self.free.append(have[p])
        have[:n] = slots
        self.borrowed[req.row] = max(self.borrowed[req.row], n)

    def released(self, req: Request) -> None:
        """``req``'s row is released: the slots it owns are free again (from what it borrows
        to ``keep_from``, where the prefix cache took the rest), and so are those chosen for
        positions it never ran."""
        keep = len(req.row_slots) if req.keep_from is None else req.keep_from
        for p in range(self.borrowed[req.row], len(req.row_slots)):
            s = req.row_slots[p]
            if s > 0 and (p < keep or p >= req.computed):
                self.free.append(s)
        self.borrowed[req.row] = 0

    def give(self, slots: Sequence[int]) -> None:
        """The prefix cache evicted ``slots``: free again."""
        self.free.extend(slots)
