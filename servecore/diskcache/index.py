"""The disk tier's index: which pages a cache directory holds, as one SQLite table.

A row per page: its key, its parent's key, the salt it was written under, its token count,
its size in bytes and when it was last used. A row is written only after its file has been
renamed into place, so a crash can leave a file without its row (set aside at start-up)
but never a row whose file was not whole when the row was written. SQLite makes each change
atomic; the table is the record of truth, the in-memory ``Entry`` map a copy of it.

>>> import tempfile, pathlib
>>> ix = Index(pathlib.Path(tempfile.mkdtemp()) / "index.sqlite")
>>> ix.add(Entry("k1", "s", "s", 4, 100, 1.0))
>>> ix.touch(["k1"], 2.0)
>>> [(e.key, e.used) for e in ix.entries()]
[('k1', 2.0)]
>>> ix.remove(["k1"]); ix.entries()
[]
"""

from __future__ import annotations

import dataclasses
import pathlib
import sqlite3
import threading
from collections.abc import Iterable

__all__ = ["Entry", "Index"]


@dataclasses.dataclass
class Entry:
    """One page the directory holds.

    >>> Entry("k", "parent", "salt", 64, 1000, 0.0).num_tokens
    64
    """

    key: str
    parent: str
    salt: str
    num_tokens: int
    num_bytes: int
    used: float


class Index:
    """The table of pages in ``path`` (created if absent), safe to call from any thread.

    >>> import tempfile, pathlib
    >>> Index(pathlib.Path(tempfile.mkdtemp()) / "i.sqlite").entries()
    []
    """

    def __init__(self, path: pathlib.Path):
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        # A rollback journal, gone after each change: a write-ahead log would sit beside the
        # table at up to megabytes, outside any small budget.
        self._db.execute("PRAGMA journal_mode=DELETE")
        self._db.execute("CREATE TABLE IF NOT EXISTS pages (key TEXT PRIMARY KEY, "
                         "parent TEXT NOT NULL, salt TEXT NOT NULL, tokens INTEGER NOT NULL, "
                         "bytes INTEGER NOT NULL, used REAL NOT NULL)")

    def check(self) -> None:
        """``sqlite3.DatabaseError`` unless SQLite reads the whole table back intact."""
        with self._lock:
            (verdict,) = self._db.execute("PRAGMA quick_check").fetchone()
            if verdict != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {verdict}")
            self._db.execute("SELECT key, parent, salt, tokens, bytes, used FROM pages"
                             ).fetchall()

    def entries(self) -> list[Entry]:
        """Every row."""
        with self._lock:
            rows = self._db.execute("SELECT key, parent, salt, tokens, bytes, used FROM pages")
            return [Entry(*row) for row in rows.fetchall()]

    def add(self, e: Entry) -> None:
        """Record ``e`` (replacing a row of its key)."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO pages VALUES (?, ?, ?, ?, ?, ?)",
                             (e.key, e.parent, e.salt, e.num_tokens, e.num_bytes, e.used))

    def remove(self, keys: Iterable[str]) -> None:
        """Forget the rows of ``keys`` (one transaction)."""
        self._batch("DELETE FROM pages WHERE key = ?", [(k,) for k in keys])

    def touch(self, keys: Iterable[str], used: float) -> None:
        """Mark ``keys`` used at ``used`` (the store's use counter; one transaction)."""
        self._batch("UPDATE pages SET used = ? WHERE key = ?", [(used, k) for k in keys])

    def _batch(self, sql: str, rows: list[tuple]) -> None:
        """``sql`` for each of ``rows`` in one transaction (one journal, one sync)."""
        if not rows:
            return
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(sql, rows)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._db.close()
