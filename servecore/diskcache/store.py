"""``DiskStore``: a directory of pages (``pagefile``) named by chained keys (``keys``), with
an index (``index``), a byte budget, a floor of free disk space, and its own threads.

What the engine sees: ``put`` a page (its arrays already on the host: materialised on the
engine's thread), ``depth`` (how many leading keys of a chain the directory holds: a lookup
in memory, no I/O), ``load`` (a ``Future`` of the pages, read on the store's reader thread,
so a request waiting for a reload does not stall the others), ``flush`` and ``close``.

Why each rule:

* **One owner.** A directory belongs to one store at a time: an exclusive ``flock`` on its
  ``LOCK`` file, held until ``close``; a second store fails at once with a message that
  names the directory and the owner's pid (two writers would evict each other's pages and
  race on the index).
* **Start-up reconciles** the directory with the index: temporary files (a write cut short),
  files without a row (written, not recorded), rows without a file and files whose size is
  not the recorded one are removed, each logged and counted in ``stats.set_aside``; the
  store then trims to its budget (a directory may be reopened with a smaller one). A page
  that fails its checks when read is removed the same way: a miss, never an error.
* **The budget holds across models.** Pages of every salt share one budget; least recently
  used *leaves* go first (a page whose children are gone), so a chain shrinks from its end
  and every page still held is reachable from its salt. A page larger than the whole budget
  is not written. Before each write the store makes room for it: the directory (its pages,
  index and lock) never exceeds ``budget_bytes``, and the disk keeps ``min_free_bytes`` free.

>>> import tempfile, pathlib
>>> from servecore.diskcache.keys import chain
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> store = DiskStore(d, budget_bytes=1 << 20, min_free_bytes=0)
>>> k = chain("00" * 16, [1, 2, 3, 4], page_size=2)
>>> store.put(k[0], "00" * 16, "00" * 16, 2, {"kv": np.zeros(4, np.float32)}, {})
True
>>> store.flush(); store.depth(k)
1
>>> [p.arrays["kv"].tolist() for p in store.load(k).result()]
[[0.0, 0.0, 0.0, 0.0]]
>>> store.close()
>>> DiskStore(d, budget_bytes=1 << 20, min_free_bytes=0).depth(k)  # a new process finds it
1
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import pathlib
import shutil
import sqlite3
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from servecore.diskcache.index import Entry, Index
from servecore.diskcache.pagefile import (
    TMP_SUFFIX,
    CorruptPage,
    Page,
    encode_page,
    read_page,
    write_page,
)

__all__ = ["MAX_QUEUED_BYTES", "DiskStats", "DiskStore", "DirectoryInUse"]

log = logging.getLogger("servecore.diskcache")

MAX_QUEUED_BYTES = 256 << 20
"""Host bytes of pages put and not yet written, at most (a larger page alone may wait)."""

_INDEX_SLACK = 4096  # what recording one more page may add to the index (a SQLite page)


class DirectoryInUse(RuntimeError):
    """Another store (another engine, perhaps another process) owns the cache directory.

    >>> issubclass(DirectoryInUse, RuntimeError)
    True
    """


@dataclasses.dataclass
class DiskStats:
    """What a store has done since it opened: pages, tokens and bytes written and read,
    pages evicted for the budget, and files set aside (half-written, unrecorded, missing or
    failing their checks).

    >>> DiskStats().pages_written
    0
    """

    pages_written: int = 0
    tokens_written: int = 0
    bytes_written: int = 0
    pages_read: int = 0
    tokens_read: int = 0
    bytes_read: int = 0
    pages_evicted: int = 0
    set_aside: int = 0


class DiskStore:
    """The pages of ``directory`` (created if absent) within ``budget_bytes``, leaving
    ``min_free_bytes`` free on its disk (see the module docstring).

    >>> import tempfile
    >>> with DiskStore(tempfile.mkdtemp(), budget_bytes=1 << 20, min_free_bytes=0) as s:
    ...     s.num_pages, s.has("00" * 16)
    (0, False)
    """

    def __init__(self, directory: str | os.PathLike, *, budget_bytes: int,
                 min_free_bytes: int = 1 << 30):
        if budget_bytes < 0 or min_free_bytes < 0:
            raise ValueError(f"budget_bytes={budget_bytes} and min_free_bytes={min_free_bytes} "
                             "must be at least 0")
        self.directory = pathlib.Path(directory).expanduser()  # the README's "~/..."
        self.budget_bytes, self.min_free_bytes = int(budget_bytes), int(min_free_bytes)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _own(self.directory)
        self.pages = self.directory / "pages"
        self.stats = DiskStats()
        self._mu = threading.Lock()  # the maps below
        self._room = threading.Condition(self._mu)  # a put waits here for queue room
        self._entries: dict[str, Entry] = {}
        self._children: dict[str, set[str]] = {}  # parent key -> keys held
        self._queued: set[str] = set()  # put, not yet written
        self._queued_bytes = 0
        # The use order (least recently used goes first) is a counter, not the wall clock: a
        # clock stepped back would make the newest pages look oldest. It starts past every
        # page the index holds (older indexes hold epoch seconds: still an order).
        self._clock = 0.0
        self._warned: set[str] = set()  # why pages went unwritten, each said once
        self.index: Index | None = None
        try:
            self.pages.mkdir(exist_ok=True)
            self.index = _open_index(self.directory / "index.sqlite", self.stats)
            self._reconcile()
        except BaseException:
            if self.index is not None:
                self.index.close()
            _release(self._lock_fd)
            raise
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="diskcache-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="diskcache-read")
        # started now: an executor starts its thread at its first task, which would add the
        # thread's start (1-5 ms here) to the first reload a new process serves
        self._reader.submit(lambda: None).result()
        self._closed = False

    # ---------------------------------------------------------------- queries ----

    @property
    def num_bytes(self) -> int:
        """Bytes of the pages the directory holds (every salt's)."""
        with self._mu:
            return sum(e.num_bytes for e in self._entries.values())

    @property
    def num_pages(self) -> int:
        """Pages the directory holds (every salt's)."""
        with self._mu:
            return len(self._entries)

    def has(self, key: str) -> bool:
        """Whether the directory holds the page ``key``."""
        with self._mu:
            return key in self._entries

    def wanted(self, key: str) -> bool:
        """Whether a ``put`` of ``key`` would be taken (neither held nor queued): ask first
        and skip materialising a page nobody will write."""
        with self._mu:
            return key not in self._entries and key not in self._queued

    def depth(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` (a chain) the directory holds."""
        with self._mu:
            n = 0
            while n < len(keys) and keys[n] in self._entries:
                n += 1
            return n

    # ----------------------------------------------------------------- writes ----

    def put(self, key: str, parent: str, salt: str, num_tokens: int,
            arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> bool:
        """Queue a page for writing (on the writer thread); False if the directory holds it
        or it is queued already. ``arrays`` must be host arrays the caller no longer
        changes."""
        self._check_open()
        size = sum(a.nbytes for a in arrays.values())
        with self._room:
            if key in self._entries or key in self._queued:
                return False
            # backpressure: what waits for the writer stays within MAX_QUEUED_BYTES of host
            # memory (a flush of a large pool would otherwise copy all of it at once)
            while self._queued_bytes and self._queued_bytes + size > MAX_QUEUED_BYTES:
                self._room.wait()
            self._queued.add(key)
            self._queued_bytes += size
        self._on_writer(self._write, key, parent, salt, num_tokens, dict(arrays), dict(meta),
                        size)
        return True

    def _on_writer(self, fn: Any, *args: Any) -> Future:
        """``fn(*args)`` on the writer thread; once the interpreter is shutting down (an
        engine closed at exit spills then, and executors take no more work) on this one."""
        try:
            return self._writer.submit(fn, *args)
        except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
            self._writer.shutdown(wait=True)  # (what was queued first goes first)
            done: Future = Future()
            done.set_result(fn(*args))
            return done

    def forget(self, salt: str) -> int:
        """Remove every page of ``salt`` (written or queued: the queue is flushed first); how
        many were removed. Pages of other salts stay.

        >>> import tempfile
        >>> with DiskStore(tempfile.mkdtemp(), budget_bytes=1 << 20, min_free_bytes=0) as d:
        ...     d.forget("s")
        0
        """
        self.flush()
        with self._mu:
            roots = list(self._children.get(salt, ()))
        keys = [k for root in roots for k in self._subtree(root)]
        self._drop(keys)
        return len(keys)

    def flush(self) -> None:
        """Wait until every queued page is written (or skipped)."""
        self._check_open()
        self._on_writer(lambda: None).result()

    def _write(self, key: str, parent: str, salt: str, num_tokens: int,
               arrays: dict[str, np.ndarray], meta: dict[str, Any], queued: int) -> None:
        try:
            with self._mu:
                orphan = parent != salt and parent not in self._entries
            if orphan:  # its parent was evicted after the put: it could never be reached
                return
            page = encode_page(key, parent, num_tokens, arrays, meta)
            size = page.size
            if not self._make_room(size, keep=parent):
                self._skipped(key, size)
                return
            path = write_page(self.pages, page)
            entry = Entry(key, parent, salt, num_tokens, size, self._tick())
            try:
                self.index.add(entry)
            except BaseException:  # unrecorded: not left on disk outside the budget
                path.unlink(missing_ok=True)
                raise
            with self._mu:
                self._add(entry)
            s = self.stats
            s.pages_written += 1
            s.tokens_written += num_tokens
            s.bytes_written += size
        except Exception:  # a full disk, a permission: the page is simply not cached
            log.exception("diskcache: writing page %s failed", key)
        finally:
            with self._room:
                self._queued.discard(key)
                self._queued_bytes -= queued
                self._room.notify_all()

    def _skipped(self, key: str, size: int) -> None:
        """A page that cannot be written: why, as a warning the first time for each reason
        (a small disk under the free-space floor writes nothing, ever)."""
        kind, why = _why_unwritten(self, size)
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("diskcache: %s", why)
        log.debug("diskcache: page %s not written: %s", key, why)

    def _tick(self) -> float:
        """The next mark of the use order."""
        with self._mu:
            self._clock += 1.0
            return self._clock

    def _make_room(self, size: int, keep: str | None = None) -> bool:
        """Evict least recently used leaves (never ``keep``) until ``size`` more bytes fit
        the budget and the free-space floor; False if they cannot."""
        if size + _INDEX_SLACK > self.budget_bytes:
            return False
        with self._mu:  # what evicting every page but ``keep`` could give at most
            freeable = sum(e.num_bytes for e in self._entries.values() if e.key != keep)
            held = sum(e.num_bytes for e in self._entries.values())
        free = shutil.disk_usage(self.directory).free
        if (held - freeable + self._overhead() + size + _INDEX_SLACK > self.budget_bytes
                or free + freeable - size < self.min_free_bytes):
            return False  # even then it would not fit: evict nothing (make_room's rule)
        while True:
            with self._mu:
                held = sum(e.num_bytes for e in self._entries.values())
                leaves = [e for e in self._entries.values()
                          if not self._children.get(e.key) and e.key != keep]
            held += self._overhead()
            free = shutil.disk_usage(self.directory).free
            # (a row may grow the index by one page: 4 KiB kept for it)
            if held + size + _INDEX_SLACK <= self.budget_bytes and \
                    free - size >= self.min_free_bytes:
                return True
            if not leaves:
                return False
            self._drop([min(leaves, key=lambda e: e.used).key], evicted=True)

    # ------------------------------------------------------------------ reads ----

    def load(self, keys: Sequence[str],
             into: Sequence[Mapping[str, np.ndarray] | None] | None = None) -> Future:
        """A ``Future`` of the pages of the leading ``keys`` the directory holds, read on the
        reader thread; it stops at the first page missing or failing its checks (that one
        is removed). ``into``: for each key, arrays to read its payload into
        (``pagefile.read_page``), or None."""
        self._check_open()
        keys = list(keys)
        into = list(into) if into is not None else [None] * len(keys)
        if len(into) != len(keys):
            raise ValueError(f"into has {len(into)} entries for {len(keys)} keys")
        return self._reader.submit(self._read, keys, into)

    def _fetch(self, key: str, into: Mapping[str, np.ndarray] | None = None
               ) -> Page | CorruptPage | None:
        """One page, read and checked (None: not held)."""
        with self._mu:
            if key not in self._entries:
                return None
        try:
            return read_page(self._path(key), key, into)
        except CorruptPage as e:
            return e

    def _read(self, keys: list[str], into: list[Mapping[str, np.ndarray] | None]
              ) -> list[Page]:
        pages: list[Page] = []
        for key, dst in zip(keys, into, strict=True):
            got = self._fetch(key, dst)
            if got is None:
                break
            if isinstance(got, CorruptPage):
                e = got
                with self._mu:
                    gone = key not in self._entries  # evicted meanwhile: a plain miss
                if not gone:
                    log.warning("diskcache: setting aside %s", e)
                    self.stats.set_aside += 1
                    self._drop(self._subtree(key))
                break
            pages.append(got)
        if pages:
            now = self._tick()
            with self._mu:
                for p in pages:
                    if p.key in self._entries:
                        self._entries[p.key].used = now
                s = self.stats
                s.pages_read += len(pages)
                s.tokens_read += sum(p.num_tokens for p in pages)
                s.bytes_read += sum(a.nbytes for p in pages for a in p.arrays.values())
            # recorded on the writer thread: a reload does not wait for the index's fsync
            self._on_writer(self.index.touch, [p.key for p in pages], now)
        return pages

    # ---------------------------------------------------------------- the end ----

    def close(self) -> None:
        """Write what is queued, stop the threads, release the directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._reader.shutdown(wait=True, cancel_futures=True)  # (a read touches the
            self._writer.shutdown(wait=True)  # index on the writer thread: readers first)
            self.index.close()
        finally:
            _release(self._lock_fd)

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- internals ----

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the disk cache {self.directory} is closed")

    def _overhead(self) -> int:
        """Bytes of the directory's own files (the index and its journal, the lock): the
        budget covers them too, so the whole directory stays within it."""
        total = 0
        for f in self.directory.iterdir():
            try:
                total += f.stat().st_size if f.is_file() else 0
            except OSError:  # (a journal file that went meanwhile)
                pass
        return total

    def _path(self, key: str) -> pathlib.Path:
        return self.pages / key

    def _add(self, e: Entry) -> None:
        self._entries[e.key] = e
        self._children.setdefault(e.parent, set()).add(e.key)

    def _subtree(self, key: str) -> list[str]:
        """``key`` and every page below it (unreachable once it goes)."""
        with self._mu:
            out, todo = [], [key]
            while todo:
                k = todo.pop()
                out.append(k)
                todo += self._children.get(k, ())
            return out

    def _drop(self, keys: list[str], evicted: bool = False) -> None:
        """Remove ``keys``' rows, files and map entries."""
        self.index.remove(keys)
        with self._mu:
            for key in keys:
                e = self._entries.pop(key, None)
                if e is not None:
                    siblings = self._children[e.parent]
                    siblings.discard(key)
                    if not siblings:
                        del self._children[e.parent]
        for key in keys:
            self._path(key).unlink(missing_ok=True)
        if evicted:
            self.stats.pages_evicted += len(keys)

    def _reconcile(self) -> None:
        rows = {e.key: e for e in self.index.entries()}
        self._clock = max((e.used for e in rows.values()), default=0.0)
        files = {p.name: p for p in self.pages.iterdir()}
        gone = []
        for name, p in files.items():
            if name.endswith(TMP_SUFFIX) or name not in rows or not p.is_file():
                why = ("half-written" if name.endswith(TMP_SUFFIX)
                       else "not in the index")
                log.warning("diskcache: setting aside %s (%s)", p, why)
                _remove(p)
                self.stats.set_aside += 1
        for key, e in rows.items():
            p = files.get(key)
            size = p.stat().st_size if p is not None and p.is_file() else None
            if size != e.num_bytes:
                log.warning("diskcache: setting aside page %s (%s)", key,
                            "its file is missing" if size is None
                            else f"{size} bytes, {e.num_bytes} recorded")
                gone.append(key)
                if p is not None:
                    _remove(p)
                self.stats.set_aside += 1
            else:
                self._add(e)
        self.index.remove(gone)
        # pages below a removed one can no longer be reached: they go too
        reached = [k for k, e in self._entries.items() if e.parent == e.salt]
        for k in list(reached):
            reached += self._subtree(k)[1:]
        orphans = set(self._entries) - set(reached)
        if orphans:
            log.info("diskcache: dropping %d pages below removed ones", len(orphans))
            self._drop(sorted(orphans), evicted=True)
        self._trim()

    def _trim(self) -> None:
        """Evict least recently used leaves until the directory is within the budget (a
        store reopened with a smaller one), whatever the free-space floor says: that floor
        decides what is written, not what is kept."""
        while True:
            with self._mu:
                held = sum(e.num_bytes for e in self._entries.values())
                leaves = [e for e in self._entries.values() if not self._children.get(e.key)]
            if held + self._overhead() <= self.budget_bytes or not leaves:
                return
            self._drop([min(leaves, key=lambda e: e.used).key], evicted=True)


def _open_index(path: pathlib.Path, stats: DiskStats) -> Index:
    """The index at ``path``; one that SQLite cannot read (garbled, cut short) is removed
    with its journal and a new one started: its pages, then in no index, are set aside
    by ``_reconcile``, so damage is misses, never a store that cannot start."""
    index = None
    try:
        index = Index(path)
        index.check()
        return index
    except sqlite3.DatabaseError as e:
        if index is not None:
            index.close()
        if isinstance(e, sqlite3.OperationalError):  # I/O, a lock: not damage, raise it
            raise
        log.warning("diskcache: the index %s is damaged (%s): starting empty", path, e)
        stats.set_aside += 1
        for damaged in (path, path.with_name(path.name + "-journal")):
            damaged.unlink(missing_ok=True)
        return Index(path)


def _why_unwritten(store: DiskStore, size: int) -> tuple[str, str]:
    """Why a page of ``size`` bytes is not written: the free-space floor, or the budget."""
    free = shutil.disk_usage(store.directory).free
    if free - size < store.min_free_bytes:
        return "floor", (f"the disk holding {store.directory} has {free} bytes free and "
                         f"min_free_bytes={store.min_free_bytes} (disk_min_free) must stay "
                         "free: nothing more is written there; lower disk_min_free or free "
                         "space")
    return "budget", (f"a page of {size} bytes does not fit budget_bytes={store.budget_bytes} "
                      "(disk_budget) beside what the directory holds")


def _remove(p: pathlib.Path) -> None:
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _own(directory: pathlib.Path) -> int:
    """Take ``directory``'s lock (``DirectoryInUse`` if another store holds it)."""
    fd = os.open(directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DirectoryInUse(
            f"the cache directory {directory} is in use by another engine (pid {owner}); "
            "give each engine its own cache_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _release(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
