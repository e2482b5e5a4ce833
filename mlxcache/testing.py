"""Hypothesis strategies and brute-force references for testing prefix caches.

Strategies (each returns a hypothesis ``SearchStrategy``):

- ``token_sequences``: one list of token ids.
- ``shared_prefix_batches``: a list of prompts that share prefixes in a tree shape: a common
  root prefix, branches off earlier prompts, duplicates, prompts that extend others and prompts
  that are prefixes of others, in any order.
- ``radix_operations``: a program of ``RadixOp`` (insert, match and lock, unlock,
  evict, reset) whose token runs overlap, for driving a radix cache.

References, small enough to read in one go, to test a cache against:

- ``ref_longest_prefix``: the longest cached prefix of a query, by brute force over a list.
- ``RefRadixCache``: what a radix cache must hold, as a dict from each cached page's full
  prefix to its slots, with the same API as ``RadixCache``; eviction is
  checked (``RefRadixCache.apply_eviction``) rather than chosen, since the tree's edges
  decide how much one eviction frees.
- ``check_radix_program``: run a program on a cache and on the reference side by side,
  failing at the first operation where they disagree.

Token lengths can be drawn as multiples of ``length_multiple``: use the cache's ``page_size``
to make every prompt whole pages, or a bucket size to bound the number of distinct shapes an
MLX model sees in one test. Nothing here imports MLX.

Examples:
    >>> from hypothesis import given, settings
    >>> from mlxcache.radix import RadixCache
    >>> @settings(max_examples=20)
    ... @given(shared_prefix_batches(vocab_size=8, max_size=6, max_len=12))
    ... def test_match_finds_the_longest_cached_prefix(prompts):
    ...     cache = RadixCache()
    ...     for i, p in enumerate(prompts[:-1]):
    ...         cache.insert(p, list(range(100 * i, 100 * i + len(p))))
    ...     slots, _, _ = cache.match_prefix(prompts[-1])
    ...     assert len(slots) == ref_longest_prefix(prompts[:-1], prompts[-1])
    >>> test_match_finds_the_longest_cached_prefix()
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

from hypothesis import strategies as st

__all__ = [
    "RadixOp",
    "RefRadixCache",
    "check_radix_program",
    "radix_operations",
    "ref_longest_prefix",
    "shared_prefix_batches",
    "token_sequences",
]


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _units(min_len: int, max_len: int, length_multiple: int) -> tuple[int, int]:
    """Lengths ``[min_len, max_len]`` as a range of multiples of ``length_multiple``."""
    _check_int("min_len", min_len, 0)
    _check_int("max_len", max_len, 0)
    _check_int("length_multiple", length_multiple, 1)
    lo, hi = -(-min_len // length_multiple), max_len // length_multiple
    if lo > hi:
        raise ValueError(
            f"no multiple of length_multiple={length_multiple} lies in "
            f"[min_len={min_len}, max_len={max_len}]"
        )
    return lo, hi


# ---------------------------------------------------------------------------- strategies ----


def token_sequences(
    vocab_size: int = 16, min_len: int = 0, max_len: int = 16, *, length_multiple: int = 1
) -> st.SearchStrategy[list[int]]:
    """Lists of token ids in ``[0, vocab_size)`` of ``min_len .. max_len`` tokens.

    Args:
        vocab_size: token ids are drawn from ``[0, vocab_size)``; a small vocabulary makes
            sequences collide and share prefixes often.
        min_len: fewest tokens.
        max_len: most tokens.
        length_multiple: every length is a multiple of this (a page size, or a shape bucket).

    Returns:
        A strategy of ``list[int]`` ``[T]``; it shrinks towards short runs of token 0.

    Examples:
        >>> from hypothesis import given, settings
        >>> @settings(max_examples=10)
        ... @given(token_sequences(vocab_size=8, min_len=2, max_len=12, length_multiple=4))
        ... def test_lengths(tokens):
        ...     assert len(tokens) in (4, 8, 12) and all(0 <= t < 8 for t in tokens)
        >>> test_lengths()
    """
    _check_int("vocab_size", vocab_size, 1)
    lo, hi = _units(min_len, max_len, length_multiple)
    token = st.integers(0, vocab_size - 1)
    if length_multiple == 1:
        return st.lists(token, min_size=lo, max_size=hi)
    page = st.lists(token, min_size=length_multiple, max_size=length_multiple)
    return st.lists(page, min_size=lo, max_size=hi).map(lambda pages: sum(pages, []))


@st.composite
def _shared_prefix_batches(
    draw, vocab_size, min_size, max_size, min_len, max_len, length_multiple, shuffle
):
    m = length_multiple
    lo, hi = _units(min_len, max_len, m)
    tokens = st.integers(0, vocab_size - 1)

    def run(units: int) -> list[int]:
        return draw(st.lists(tokens, min_size=units * m, max_size=units * m))

    root_units = draw(st.integers(0, hi))
    root = run(root_units)
    prompts: list[list[int]] = []
    for _ in range(draw(st.integers(min_size, max_size))):
        # -1: branch off the root itself; else off an earlier prompt (they all start with root)
        parent = draw(st.integers(-1, len(prompts) - 1))
        base = root if parent < 0 else prompts[parent]
        cut = draw(st.integers(root_units, len(base) // m))  # keep >= the root
        # an empty suffix makes a duplicate (cut = all of base) or a prefix of base
        suffix = draw(st.integers(max(0, lo - cut), hi - cut))
        prompts.append(base[: cut * m] + run(suffix))
    if shuffle and len(prompts) > 1:
        prompts = [prompts[i] for i in draw(st.permutations(range(len(prompts))))]
    return prompts


def shared_prefix_batches(
    vocab_size: int = 16,
    min_size: int = 1,
    max_size: int = 8,
    min_len: int = 1,
    max_len: int = 24,
    *,
    length_multiple: int = 1,
    shuffle: bool = True,
) -> st.SearchStrategy[list[list[int]]]:
    """Batches of prompts that share prefixes the way real traffic does: as a tree.

    A root prefix (possibly empty) starts every prompt. Each prompt then branches off the root
    or off an earlier prompt at a random point and adds its own random suffix, so a batch holds
    branches, duplicates (an empty suffix at the end of a prompt), prompts that extend others
    and prompts that are prefixes of others. With ``shuffle`` the batch comes in a random
    order, so a prompt can arrive before or after the prompts it shares with. Everything
    shrinks towards fewer, shorter prompts and less sharing.

    Args:
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
        min_size: fewest prompts.
        max_size: most prompts.
        min_len: fewest tokens per prompt (>= 1 for an engine, which rejects empty prompts).
        max_len: most tokens per prompt.
        length_multiple: every prompt length and every branch point is a multiple of this:
            the cache's ``page_size`` for whole-page prompts, or a bucket size that bounds the
            distinct shapes a model sees.
        shuffle: draw the order of the prompts too (else each comes after the one it
            branched off).

    Returns:
        A strategy of ``list[list[int]]``: ``min_size .. max_size`` prompts ``[T_i]``.

    Examples:
        Whole-page prompts (``length_multiple`` = the page size): each insert reports as
        cached exactly the longest prefix shared with an earlier prompt.

        >>> from hypothesis import given, settings
        >>> from mlxcache.radix import RadixCache
        >>> @settings(max_examples=20)
        ... @given(shared_prefix_batches(vocab_size=4, max_size=5, max_len=8, length_multiple=2))
        ... def test_insert_reports_the_shared_prefix(prompts):
        ...     cache = RadixCache(page_size=2)
        ...     for i, p in enumerate(prompts):
        ...         cached = cache.insert(p, [100 * i + j for j in range(len(p))])
        ...         assert cached == ref_longest_prefix(prompts[:i], p, page_size=2)
        >>> test_insert_reports_the_shared_prefix()
    """
    _check_int("vocab_size", vocab_size, 1)
    _check_int("min_size", min_size, 0)
    _check_int("max_size", max_size, min_size)
    _units(min_len, max_len, length_multiple)  # validates eagerly, not at the first draw
    return _shared_prefix_batches(
        vocab_size, min_size, max_size, min_len, max_len, length_multiple, shuffle
    )


class RadixOp(NamedTuple):
    """One step of a radix-cache program, as drawn by ``radix_operations``.

    ``kind`` is one of

    - ``"insert"``: ``cache.insert(tokens, fresh_slots, extra_key)``;
    - ``"match"``: ``cache.match_prefix(tokens, extra_key)``, then ``cache.lock(node)`` when
      ``lock`` (the node is held until an ``"unlock"``);
    - ``"unlock"``: ``cache.unlock`` the held node number ``n % len(held)`` (nothing if none);
    - ``"evict"``: ``cache.evict(n)``;
    - ``"reset"``: ``cache.reset()`` (every held node is dropped).

    ``check_radix_program`` gives these meanings; the repr is the call, compact.

    Examples:
        >>> RadixOp("insert", (1, 2, 3)), RadixOp("match", (1, 2), lock=True)
        (insert([1, 2, 3]), match([1, 2], lock=True))
        >>> RadixOp("evict", n=4), RadixOp("match", (5,), extra_key="lora")
        (evict(4), match([5], extra_key='lora'))
    """

    kind: str
    tokens: tuple[int, ...] = ()
    extra_key: Hashable | None = None
    lock: bool = False
    n: int = 0

    def __repr__(self) -> str:
        if self.kind in ("insert", "match"):
            args = [str(list(self.tokens))]
            if self.extra_key is not None:
                args.append(f"extra_key={self.extra_key!r}")
            if self.lock:
                args.append("lock=True")
        elif self.kind in ("unlock", "evict"):
            args = [str(self.n)]
        else:
            args = []
        return f"{self.kind}({', '.join(args)})"


# Weighted towards inserts and matches; the first entry is what ops shrink to.
_KINDS = ("insert", "match", "insert", "match", "evict", "match", "unlock", "insert", "evict")


@st.composite
def _radix_operations(draw, vocab_size, max_len, min_size, max_size, extra_keys, max_evict, reset):
    kinds = _KINDS + (("reset",) if reset else ())
    fresh = token_sequences(vocab_size, 0, max_len)
    seen: list[tuple[int, ...]] = []
    ops = []
    for _ in range(draw(st.integers(min_size, max_size))):
        kind = draw(st.sampled_from(kinds))
        if kind in ("insert", "match"):
            if seen and draw(st.booleans()):  # overlap an earlier run: cut it, add a tail
                base = draw(st.sampled_from(seen))
                cut = draw(st.integers(0, len(base)))
                tokens = base[:cut] + tuple(draw(token_sequences(vocab_size, 0, max_len - cut)))
            else:
                tokens = tuple(draw(fresh))
            seen.append(tokens)
            extra_key = draw(st.sampled_from(extra_keys))
            lock = kind == "match" and draw(st.booleans())
            ops.append(RadixOp(kind, tokens, extra_key, lock))
        elif kind == "evict":
            ops.append(RadixOp(kind, n=draw(st.integers(0, max_evict))))
        elif kind == "unlock":
            ops.append(RadixOp(kind, n=draw(st.integers(0, max_size))))
        else:
            ops.append(RadixOp(kind))
    return ops


def radix_operations(
    vocab_size: int = 4,
    max_len: int = 9,
    min_size: int = 0,
    max_size: int = 30,
    *,
    extra_keys: Sequence[Hashable | None] = (None,),
    max_evict: int = 6,
    reset: bool = True,
) -> st.SearchStrategy[list[RadixOp]]:
    """Programs of ``RadixOp`` for a radix cache: inserts, matches (some locked), unlocks,
    evictions and resets, in any order.

    About half of the token runs reuse a prefix of an earlier run with a new tail, so runs
    split edges, extend and duplicate each other, and matches hit. Run a program with
    ``check_radix_program``, or interpret the ops yourself.

    Args:
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
        max_len: most tokens per run.
        min_size: fewest operations.
        max_size: most operations.
        extra_keys: namespaces to draw from (``extra_key`` of inserts and matches).
        max_evict: most tokens one ``"evict"`` asks for.
        reset: include ``"reset"`` operations.

    Returns:
        A strategy of ``list[RadixOp]``.

    Examples:
        >>> from hypothesis import given, settings
        >>> from mlxcache.radix import RadixCache
        >>> @settings(max_examples=20)
        ... @given(radix_operations(max_size=15, extra_keys=[None, "a"]))
        ... def test_radix_cache_matches_the_reference(program):
        ...     check_radix_program(program, RadixCache(page_size=2))
        >>> test_radix_cache_matches_the_reference()
    """
    _check_int("vocab_size", vocab_size, 1)
    _check_int("max_len", max_len, 0)
    _check_int("min_size", min_size, 0)
    _check_int("max_size", max_size, min_size)
    _check_int("max_evict", max_evict, 0)
    extra_keys = tuple(extra_keys)
    if not extra_keys:
        raise ValueError("extra_keys must name at least one namespace (None is the default)")
    return _radix_operations(vocab_size, max_len, min_size, max_size, extra_keys, max_evict, reset)


# ---------------------------------------------------------------------------- references ----


def ref_longest_prefix(
    cached_sequences: Sequence[Sequence[int]], query: Sequence[int], page_size: int = 1
) -> int:
    """Length of the longest prefix of ``query`` that some cached sequence starts with.

    Brute force over the list: what ``len(RadixCache(page_size).match_prefix(query)[0])`` must
    be after inserting every sequence of ``cached_sequences`` (and evicting nothing). Only whole
    pages count: each sequence is cut to whole pages, and so is the answer.

    Args:
        cached_sequences: token id lists ``[T_i]`` that were inserted.
        query: token ids ``[T]``.
        page_size: tokens per page.

    Examples:
        >>> ref_longest_prefix([[1, 2, 3], [1, 4]], [1, 2, 9])
        2
        >>> ref_longest_prefix([[1, 2, 3], [1, 4]], [1, 2, 3], page_size=2)
        2
        >>> ref_longest_prefix([], [1])
        0
    """
    _check_int("page_size", page_size, 1)
    best = 0
    for seq in cached_sequences:
        n = min(len(seq) - len(seq) % page_size, len(query))
        i = 0
        while i < n and seq[i] == query[i]:
            i += 1
        best = max(best, i - i % page_size)
    return best


PageKey = tuple[Hashable, tuple[int, ...]]
"""``(extra_key, prefix)``: a cached page, named by every token up to and including it."""


class RefRadixCache:
    """A brute-force model of what a ``RadixCache`` holds.

    The state is a dict from each cached page, named ``(extra_key, prefix)`` by all the tokens
    up to and including it, to that page's slots, plus each page's last access (one tick per
    ``match_prefix`` / ``insert``, as in the tree) and a count of locks per matched prefix. It
    has the tree's API (``match_prefix``, ``insert``, ``lock``, ``unlock``, ``reset`` and the
    three sizes), with handles ``(extra_key, prefix)`` instead of nodes. It does not choose
    evictions: ``apply_eviction`` checks the slots a real ``evict`` returned and removes
    them.

    Args:
        page_size: granularity in tokens, as the tree's.

    Examples:
        >>> ref = RefRadixCache()
        >>> ref.insert([1, 2, 3], [10, 11, 12]), ref.insert([1, 2, 4], [20, 21, 22])
        (0, 2)
        >>> slots, handle = ref.match_prefix([1, 2, 4, 5])
        >>> slots, handle
        ([10, 11, 22], (None, (1, 2, 4)))
        >>> ref.lock(handle)
        >>> ref.total_size, ref.protected_size, ref.evictable_size
        (4, 3, 1)
        >>> ref.apply_eviction([12], num_tokens=1)   # [1, 2, 3]'s last page: valid
        >>> ref.apply_eviction([22], num_tokens=1)   # locked
        Traceback (most recent call last):
        ...
        AssertionError: evicted locked pages: [(None, (1, 2, 4))]
    """

    def __init__(self, page_size: int = 1):
        _check_int("page_size", page_size, 1)
        self.page_size = page_size
        self.reset()

    def reset(self) -> None:
        """Forget every page and lock (the tree's ``reset``).

        Examples:
            >>> ref = RefRadixCache()
            >>> _ = ref.insert([1], [10])
            >>> ref.reset()
            >>> ref.total_size
            0
        """
        self.pages: dict[PageKey, tuple[int, ...]] = {}
        self.last_access: dict[PageKey, int] = {}
        self.locks: Counter[PageKey] = Counter()
        self._clock = 0

    # ------------------------------------------------------------------------ queries ----

    def _page_keys(self, extra_key: Hashable | None, tokens: Sequence[int], n: int) -> list:
        """Keys of the first ``n`` tokens' pages (``n`` a multiple of the page size)."""
        tokens = tuple(tokens)
        step = self.page_size
        return [(extra_key, tokens[:j]) for j in range(step, n + 1, step)]

    def cached_len(self, tokens: Sequence[int], extra_key: Hashable | None = None) -> int:
        """Tokens of the longest cached prefix of ``tokens`` (whole pages); touches nothing.

        Examples:
            >>> ref = RefRadixCache(page_size=2)
            >>> _ = ref.insert([1, 2, 3, 4], [10, 11, 12, 13])
            >>> ref.cached_len([1, 2, 3, 5]), ref.cached_len([1, 2, 3, 4, 5])
            (2, 4)
        """
        tokens = tuple(tokens)
        n = 0
        while n + self.page_size <= len(tokens) and (extra_key, tokens[: n + self.page_size]) in (
            self.pages
        ):
            n += self.page_size
        return n

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def match_prefix(
        self, tokens: Sequence[int], extra_key: Hashable | None = None
    ) -> tuple[list[int], PageKey]:
        """Slots of the longest cached prefix and its handle ``(extra_key, prefix)``.

        Marks the matched pages as used now.

        Examples:
            >>> ref = RefRadixCache()
            >>> _ = ref.insert([1, 2, 3], [10, 11, 12])
            >>> ref.match_prefix([1, 2, 7])
            ([10, 11], (None, (1, 2)))
        """
        n = self.cached_len(tokens, extra_key)
        tick = self._tick()
        keys = self._page_keys(extra_key, tokens, n)
        for key in keys:
            self.last_access[key] = tick
        return [s for key in keys for s in self.pages[key]], (extra_key, tuple(tokens[:n]))

    def insert(
        self, tokens: Sequence[int], slots: Sequence[int], extra_key: Hashable | None = None
    ) -> int:
        """Cache ``tokens`` (whole pages) with ``slots``; how many leading tokens were cached.

        As in the tree, pages already cached keep their slots: the caller's slots for them are
        not stored.

        Examples:
            >>> ref = RefRadixCache()
            >>> ref.insert([1, 2], [10, 11]), ref.insert([1, 2, 3], [20, 21, 22])
            (0, 2)
            >>> ref.match_prefix([1, 2, 3])[0]
            [10, 11, 22]
        """
        if len(tokens) != len(slots):
            raise ValueError(
                f"tokens and slots must have the same length, got {len(tokens)} and {len(slots)}"
            )
        whole = len(tokens) - len(tokens) % self.page_size
        cached = self.cached_len(tokens, extra_key)
        tick = self._tick()
        for key in self._page_keys(extra_key, tokens, whole):
            end = len(key[1])
            if end > cached:
                self.pages[key] = tuple(int(s) for s in slots[end - self.page_size : end])
            self.last_access[key] = tick
        return cached

    # -------------------------------------------------------------------------- locks ----

    def lock(self, handle: PageKey) -> None:
        """Pin the pages of ``handle`` (from ``match_prefix``) until ``unlock``.

        Examples:
            >>> ref = RefRadixCache()
            >>> _ = ref.insert([1, 2], [10, 11])
            >>> ref.lock(ref.match_prefix([1, 2])[1])
            >>> ref.protected_size
            2
        """
        extra_key, prefix = handle
        if self.cached_len(prefix, extra_key) != len(prefix):
            raise ValueError(f"lock of {handle!r}, which is not cached")
        self.locks[handle] += 1

    def unlock(self, handle: PageKey) -> None:
        """Release one ``lock`` of ``handle``; ValueError if it holds none.

        Examples:
            >>> ref = RefRadixCache()
            >>> ref.unlock((None, (1,)))
            Traceback (most recent call last):
            ...
            ValueError: unlock of (None, (1,)), which holds no lock of its own
        """
        if self.locks.get(handle, 0) <= 0:
            raise ValueError(f"unlock of {handle!r}, which holds no lock of its own")
        self.locks[handle] -= 1
        if not self.locks[handle]:
            del self.locks[handle]

    def locked_pages(self) -> set[PageKey]:
        """Pages pinned by at least one lock.

        Examples:
            >>> ref = RefRadixCache()
            >>> _ = ref.insert([1, 2], [10, 11])
            >>> ref.lock((None, (1,)))
            >>> ref.locked_pages()
            {(None, (1,))}
        """
        return {
            key
            for (extra_key, prefix) in self.locks
            for key in self._page_keys(extra_key, prefix, len(prefix))
        }

    # ---------------------------------------------------------------------------- sizes ----

    @property
    def total_size(self) -> int:
        """Tokens cached."""
        return self.page_size * len(self.pages)

    @property
    def protected_size(self) -> int:
        """Tokens in locked pages."""
        return self.page_size * len(self.locked_pages())

    @property
    def evictable_size(self) -> int:
        """Tokens in unlocked pages."""
        return self.total_size - self.protected_size

    # ------------------------------------------------------------------------- eviction ----

    def apply_eviction(self, freed: Sequence[int], num_tokens: int) -> None:
        """Check that ``freed``, what ``evict(num_tokens)`` returned, is a valid LRU eviction,
        and remove those pages.

        Valid means: no slot twice; only cached slots, and whole pages of them; no locked page;
        only leaves go (what stays is still closed under prefixes); fewer than ``num_tokens``
        only when nothing evictable is left; and least recently used first: no evicted page was
        used after a leaf page that stays unlocked. Raises AssertionError saying which rule
        broke; then nothing is removed.

        Args:
            freed: the slots ``evict`` returned.
            num_tokens: the tokens it was asked to free.

        Examples:
            >>> ref = RefRadixCache()
            >>> _ = ref.insert([1, 2], [10, 11]), ref.insert([3], [12])
            >>> _ = ref.match_prefix([3])                 # [1, 2] is now least recently used
            >>> ref.apply_eviction([12], num_tokens=1)
            Traceback (most recent call last):
            ...
            AssertionError: not least recently used first: evicted pages used at tick 3, ...
            >>> ref.apply_eviction([10, 11], num_tokens=1)
            >>> ref.total_size
            1
        """
        freed = [int(s) for s in freed]
        if len(set(freed)) != len(freed):
            dup = sorted(s for s, c in Counter(freed).items() if c > 1)
            raise AssertionError(f"slots evicted twice: {dup}")
        by_slot = {s: key for key, page in self.pages.items() for s in page}
        strangers = [s for s in freed if s not in by_slot]
        if strangers:
            raise AssertionError(f"evicted slots that were not cached: {strangers}")
        gone = {by_slot[s] for s in freed}
        partial = sorted((k for k in gone if not set(self.pages[k]) <= set(freed)), key=repr)
        if partial:
            raise AssertionError(f"evicted part of a page: {partial}")
        locked = self.locked_pages()
        if gone & locked:
            raise AssertionError(f"evicted locked pages: {sorted(gone & locked, key=repr)}")
        stay = self.pages.keys() - gone
        step = self.page_size
        orphans = sorted(
            (
                (extra_key, prefix)
                for extra_key, prefix in stay
                if len(prefix) > step and (extra_key, prefix[:-step]) not in stay
            ),
            key=repr,
        )
        if orphans:
            raise AssertionError(f"evicted a page whose extensions stay cached: {orphans}")
        left = step * len(stay - locked)
        if len(freed) < num_tokens and left:
            raise AssertionError(
                f"freed {len(freed)} < {num_tokens} tokens while {left} evictable remain"
            )
        parents = {(extra_key, prefix[:-step]) for extra_key, prefix in stay}
        leaves = stay - locked - parents
        if gone and leaves:
            newest_gone = max(self.last_access[key] for key in gone)
            oldest_leaf = min(self.last_access[key] for key in leaves)
            if newest_gone > oldest_leaf:
                raise AssertionError(
                    f"not least recently used first: evicted pages used at tick {newest_gone}, "
                    f"kept an unlocked leaf last used at tick {oldest_leaf}"
                )
        for key in gone:
            del self.pages[key]
            del self.last_access[key]


def check_radix_program(program: Sequence[RadixOp], cache: Any) -> RefRadixCache:
    """Run ``program`` on ``cache`` and on a ``RefRadixCache``; assert they agree.

    After every operation: ``match_prefix`` returns the reference's slots, ``insert`` the same
    count, ``evict`` a valid LRU eviction (``RefRadixCache.apply_eviction``), and the
    three sizes agree. Inserts get fresh slot ids (1, 2, ...), as from an allocator. ``cache``
    is a fresh ``RadixCache`` or anything with its API and a
    ``page_size``.

    Args:
        program: operations, e.g. drawn by ``radix_operations``.
        cache: the cache under test, empty.

    Returns:
        The reference after the program, for further checks.

    Raises:
        AssertionError: naming the operation (its index and repr) where they disagree.

    Examples:
        >>> from mlxcache.radix import RadixCache
        >>> program = [RadixOp("insert", (1, 2, 3)), RadixOp("match", (1, 2), lock=True),
        ...            RadixOp("evict", n=5), RadixOp("unlock"), RadixOp("evict", n=5)]
        >>> check_radix_program(program, RadixCache()).total_size
        0
    """
    ref = RefRadixCache(cache.page_size)
    held: list[tuple[Any, PageKey]] = []
    next_slot = 1
    for i, op in enumerate(program):
        where = f"op {i} {op!r}"
        if op.kind == "insert":
            slots = list(range(next_slot, next_slot + len(op.tokens)))
            next_slot += len(op.tokens)
            want = ref.insert(op.tokens, slots, op.extra_key)
            got = cache.insert(list(op.tokens), slots, op.extra_key)
            _agree(where, "insert returned", got, want)
        elif op.kind == "match":
            want, handle = ref.match_prefix(op.tokens, op.extra_key)
            got, node, _ = cache.match_prefix(list(op.tokens), op.extra_key)
            _agree(where, "match_prefix slots", list(got), want)
            if op.lock:
                cache.lock(node)
                ref.lock(handle)
                held.append((node, handle))
        elif op.kind == "unlock":
            if held:
                node, handle = held.pop(op.n % len(held))
                cache.unlock(node)
                ref.unlock(handle)
        elif op.kind == "evict":
            freed = cache.evict(op.n).slots
            try:
                ref.apply_eviction(freed, op.n)
            except AssertionError as e:
                raise AssertionError(f"{where}: evict returned {freed}: {e}") from None
        elif op.kind == "reset":
            cache.reset()
            ref.reset()
            held.clear()
        else:
            raise ValueError(f"{where}: unknown kind {op.kind!r}")
        for size in ("total_size", "evictable_size", "protected_size"):
            _agree(where, size, getattr(cache, size), getattr(ref, size))
    return ref


def _agree(where: str, what: str, got: Any, want: Any) -> None:
    if got != want:
        raise AssertionError(f"{where}: {what} {got!r}, the reference says {want!r}")
