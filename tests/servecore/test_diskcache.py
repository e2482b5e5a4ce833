"""The disk tier's store (``servecore.diskcache``) on a real directory, in real processes.

The oracle is a dictionary of what was put: every page the store gives back equals the
page put under that key, byte for byte; every page it holds is reachable from its salt;
it never holds more than its budget; and whatever a restart, a crash or a damaged file
leaves behind, the next store starts, counts the damage as misses and serves the rest.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from servecore.diskcache import DirectoryInUse, DiskStore, chain, salt
from servecore.diskcache.pagefile import MAGIC

PAGE = 4  # tokens per page
SALT = salt({"model": "test"})


def _arrays(key: str, n: int = 64) -> dict[str, np.ndarray]:
    """A page's arrays, drawn from its key (so a wrong page cannot pass for it)."""
    rng = np.random.default_rng(int(key[:8], 16))
    return {"kv": rng.standard_normal((PAGE, n)).astype(np.float16),
            "state": rng.integers(0, 1 << 30, size=(3,), dtype=np.int32)}


def _put_chain(store: DiskStore, tokens: list[int], salt_key: str = SALT) -> list[str]:
    keys = chain(salt_key, tokens, PAGE)
    parent = salt_key
    for key in keys:
        store.put(key, parent, salt_key, PAGE, _arrays(key), {"len": PAGE})
        parent = key
    store.flush()
    return keys


def _check_pages(store: DiskStore, keys: list[str]) -> int:
    pages = store.load(keys).result()
    for page, key in zip(pages, keys, strict=False):
        assert page.key == key and page.num_tokens == PAGE
        for name, a in _arrays(key).items():
            assert page.arrays[name].dtype == a.dtype and np.array_equal(page.arrays[name], a)
    return len(pages)


def test_a_new_store_on_the_directory_finds_the_pages_and_a_second_is_refused(tmp_path):
    store = DiskStore(tmp_path, budget_bytes=1 << 20, min_free_bytes=0)
    keys = _put_chain(store, list(range(10)))  # two whole pages
    assert len(keys) == 2 and store.depth(keys) == 2 and store.stats.pages_written == 2
    with pytest.raises(DirectoryInUse, match=f"{tmp_path}.*pid {os.getpid()}"):
        DiskStore(tmp_path, budget_bytes=1 << 20, min_free_bytes=0)
    store.close()
    store.close()  # idempotent
    with DiskStore(tmp_path, budget_bytes=1 << 20, min_free_bytes=0) as again:
        assert again.depth(keys) == 2 and _check_pages(again, keys) == 2
        assert again.stats.set_aside == 0
        # another salt (other weights, dtype, tokenizer, ...) shares no key
        assert again.depth(chain(salt({"model": "other"}), list(range(10)), PAGE)) == 0


def test_damage_of_every_kind_is_a_miss_and_the_rest_is_served(tmp_path):
    with DiskStore(tmp_path, budget_bytes=1 << 20, min_free_bytes=0) as store:
        chains = [_put_chain(store, [i] * 4 + list(range(4))) for i in range(5)]
    pages = tmp_path / "pages"
    truncated, missing, altered = chains[0][1], chains[1][1], chains[2][0]
    data = (pages / truncated).read_bytes()
    (pages / truncated).write_bytes(data[:-3])
    (pages / missing).unlink()  # an index entry without its file
    blob = bytearray((pages / altered).read_bytes())  # same size, one byte changed
    blob[-1] ^= 0xFF
    (pages / altered).write_bytes(bytes(blob))
    (pages / ("ab" * 16)).write_bytes(MAGIC + b"junk")  # a file without its entry
    (pages / f".{'cd' * 16}.0123.tmp").write_bytes(b"half")  # a stale temporary file
    with DiskStore(tmp_path, budget_bytes=1 << 20, min_free_bytes=0) as store:
        assert store.stats.set_aside == 4  # truncated, missing, unrecorded, temporary
        assert sorted(p.name for p in pages.iterdir()) == sorted(
            k for c in chains for k in c if k not in (truncated, missing))
        assert [store.depth(c) for c in chains] == [1, 1, 2, 2, 2]
        # the altered page passes the size check; its digest fails when read: a miss
        assert _check_pages(store, chains[2]) == 0 and store.stats.set_aside == 5
        assert store.depth(chains[2]) == 0
        assert [_check_pages(store, c) for c in chains[3:]] == [2, 2]


@pytest.mark.parametrize("where", ["os.replace", "Index.add"])
def test_a_process_killed_in_the_middle_of_a_write(tmp_path, where):
    """The writer dies (SIGKILL) before its third page is renamed into place, or after the
    rename and before the index records it; the next process starts and serves the two pages
    written before."""
    keys = chain(SALT, list(range(16)), PAGE)
    script = textwrap.dedent(f"""
        import os, signal, sys
        import numpy as np
        sys.path.insert(0, {os.getcwd()!r})
        from servecore.diskcache import store as S
        calls = []
        def die(*a, real=S.os.replace if {where!r} == "os.replace" else S.Index.add):
            calls.append(1)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a)
        if {where!r} == "os.replace":
            import servecore.diskcache.pagefile as P
            P.os.replace = die
        else:
            S.Index.add = lambda self, e, die=die: die(self, e)
        store = S.DiskStore({str(tmp_path)!r}, budget_bytes=1 << 20, min_free_bytes=0)
        parent = {SALT!r}
        for key in {keys!r}:
            store.put(key, parent, parent if parent == {SALT!r} else {SALT!r}, {PAGE},
                      {{"kv": np.full(({PAGE}, 8), int(key[:4], 16) % 7, np.float16)}}, {{}})
            parent = key
        store.flush()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    with DiskStore(tmp_path, budget_bytes=1 << 20, min_free_bytes=0) as store:  # the lock
        assert store.stats.set_aside == 1  # the temporary file, or the unrecorded page
        assert store.depth(keys) == 2
        pages = store.load(keys).result()
        assert [p.key for p in pages] == keys[:2]
        assert [int(p.arrays["kv"][0, 0]) for p in pages] == [int(k[:4], 16) % 7
                                                               for k in keys[:2]]
        _put_chain(store, list(range(16)))  # and it writes the rest
        assert store.depth(keys) == 4


def _du(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_pages_read_in_place_into_joined_arrays(tmp_path):
    """``load(keys, into=...)`` reads each payload straight into the caller's slices (a reload
    joins pages without copying them); a page whose arrays are not the expected ones is a
    miss that ends the read, and is set aside like any damaged page."""
    store = DiskStore(tmp_path, budget_bytes=1 << 20, min_free_bytes=0)
    keys = _put_chain(store, list(range(13)))  # three whole pages
    joined = {"kv": np.empty((3 * PAGE, 64), np.float16), "state": np.empty((3, 3), np.int32)}
    into = [{"kv": joined["kv"][i * PAGE:(i + 1) * PAGE], "state": joined["state"][i]}
            for i in range(3)]
    pages = store.load(keys, into).result()
    assert len(pages) == 3
    for i, key in enumerate(keys):
        want = _arrays(key)
        assert np.array_equal(joined["kv"][i * PAGE:(i + 1) * PAGE], want["kv"])
        assert np.array_equal(joined["state"][i], want["state"])
        assert np.shares_memory(pages[i].arrays["kv"], joined["kv"])
    wrong = [into[0], {"kv": np.empty((PAGE, 32), np.float16), "state": into[1]["state"]},
             into[2]]
    assert len(store.load(keys, wrong).result()) == 1
    assert store.stats.set_aside == 1 and store.depth(keys) == 1
    with pytest.raises(ValueError, match="into has 1 entries for 3 keys"):
        store.load(keys, into[:1])
    store.close()


def test_a_long_session_with_a_small_budget_never_exceeds_it(tmp_path):
    budget = 40_000  # the index (about 12 KB) and a few dozen pages
    rng = np.random.default_rng(0)
    with DiskStore(tmp_path, budget_bytes=budget, min_free_bytes=0) as store:
        for i in range(60):
            head = [int(rng.integers(0, 3))] * PAGE  # three shared first pages
            keys = _put_chain(store, head + rng.integers(0, 50, size=8).tolist())
            assert _du(tmp_path) <= budget, i  # the whole directory, index and lock too
            # what it holds is reachable and whole; the newest chain is held
            assert store.depth(keys) == len(keys) and _check_pages(store, keys) == 3
        assert store.stats.pages_evicted > 0
        page_bytes = store.num_bytes // store.num_pages
        assert _du(tmp_path) > budget - 4096 - 2 * page_bytes  # used, not just bounded
    # reopened with a smaller budget: trimmed at start, whatever the free-space floor
    import shutil

    floor = shutil.disk_usage(tmp_path).free + (1 << 30)  # a disk under its floor
    with DiskStore(tmp_path, budget_bytes=budget // 2, min_free_bytes=floor) as store:
        assert _du(tmp_path) <= budget // 2 and store.num_pages > 0


def test_the_least_recently_used_page_goes_first_whatever_the_clock_says(tmp_path,
                                                                         monkeypatch):
    """Use order is the order of puts and loads, not the wall clock's: with the clock stepped
    back an hour between two pages, the older page is still the one evicted."""
    import time

    page_bytes = None
    clock = [1_700_000_000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    with DiskStore(tmp_path, budget_bytes=10**6, min_free_bytes=0) as store:
        old = _put_chain(store, [1] * PAGE)
        page_bytes = store.num_bytes
    clock[0] -= 3600.0  # an NTP step back, or a reboot into a wrong clock
    budget = _du(tmp_path) + page_bytes + 4096 + page_bytes // 2  # one more page, not two
    with DiskStore(tmp_path, budget_bytes=budget, min_free_bytes=0) as store:
        new = _put_chain(store, [2] * PAGE)
        assert store.has(old[0]) and store.has(new[0])
        third = _put_chain(store, [3] * PAGE)
        assert store.has(third[0]) and store.has(new[0]) and not store.has(old[0])


@pytest.mark.parametrize("damage", ["garbled", "cut short", "emptied", "not sqlite"])
def test_a_damaged_index_is_a_miss_not_a_store_that_cannot_start(tmp_path, damage):
    with DiskStore(tmp_path, budget_bytes=1 << 20, min_free_bytes=0) as store:
        keys = _put_chain(store, list(range(3 * PAGE)))
    index = tmp_path / "index.sqlite"
    raw = index.read_bytes()
    index.write_bytes({"garbled": raw[:100] + os.urandom(len(raw) - 200) + raw[-100:],
                       "cut short": raw[:len(raw) // 3], "emptied": b"\0" * len(raw),
                       "not sqlite": b"hello"}[damage])
    with DiskStore(tmp_path, budget_bytes=1 << 20, min_free_bytes=0) as store:
        assert _check_pages(store, keys) == store.depth(keys)  # what it serves is whole
        again = _put_chain(store, list(range(3 * PAGE)))
        assert _check_pages(store, again) == 3
    with DiskStore(tmp_path, budget_bytes=1 << 20, min_free_bytes=0) as store:
        assert store.depth(keys) == 3  # and the new index holds


def test_a_disk_below_its_free_space_floor_says_so_once(tmp_path, caplog):
    """A small disk under ``min_free_bytes`` writes nothing: one warning names that floor
    (not the budget), however many pages are refused."""
    import logging
    import shutil

    free = shutil.disk_usage(tmp_path).free
    with caplog.at_level(logging.WARNING, logger="servecore.diskcache"):
        with DiskStore(tmp_path, budget_bytes=1 << 20, min_free_bytes=free + (1 << 30)) as st:
            _put_chain(st, list(range(3 * PAGE)))
            _put_chain(st, list(range(100, 100 + 3 * PAGE)))
            assert st.num_pages == 0
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "min_free_bytes" in said[0] and "disk_min_free" in said[0], said


@pytest.mark.parametrize("edit", [(b"[4, 64]", b"[8, 32]"),            # a shape, same bytes
                                  (b'"<f2"', b'"<i2"'),                # a dtype, same size
                                  (b'"tokens": 4', b'"tokens": 5')])    # the token count
def test_a_page_whose_header_was_altered_is_a_miss(tmp_path, edit):
    """Everything read is checked: an altered header (whose payload still has the length it
    says) is a miss, never arrays of another shape or dtype."""
    with DiskStore(tmp_path, budget_bytes=1 << 20, min_free_bytes=0) as store:
        (key,) = _put_chain(store, list(range(PAGE)))
    path = tmp_path / "pages" / key
    raw = path.read_bytes()
    assert raw.count(edit[0]) == 1
    path.write_bytes(raw.replace(*edit))
    with DiskStore(tmp_path, budget_bytes=1 << 20, min_free_bytes=0) as store:
        assert store.load([key]).result() == [] and store.stats.set_aside == 1


def test_a_page_larger_than_the_budget_is_not_written(tmp_path):
    with DiskStore(tmp_path, budget_bytes=100, min_free_bytes=0) as store:
        assert _put_chain(store, [1, 2, 3, 4]) and store.num_pages == 0
    with pytest.raises(ValueError, match="budget_bytes=-1"):
        DiskStore(tmp_path, budget_bytes=-1)


class DiskMachine(RuleBasedStateMachine):
    """Chains put, loaded, flushed and the store restarted, against the dictionary of what
    was put."""

    def __init__(self):
        super().__init__()
        import tempfile

        self.dir = tempfile.mkdtemp()
        self.budget = 20_000  # the index and about eight pages: evictions happen
        self.store = DiskStore(self.dir, budget_bytes=self.budget, min_free_bytes=0)
        self.put_keys: dict[str, str] = {}  # key -> parent

    @rule(tokens=st.lists(st.integers(0, 3), min_size=PAGE, max_size=4 * PAGE))
    def put(self, tokens):
        keys = chain(SALT, tokens, PAGE)
        parent = SALT
        for key in keys:
            self.store.put(key, parent, SALT, PAGE, _arrays(key), {})
            self.put_keys[key] = parent
            parent = key

    @rule()
    def flush(self):
        self.store.flush()

    @rule(tokens=st.lists(st.integers(0, 3), min_size=PAGE, max_size=4 * PAGE))
    def load(self, tokens):
        keys = chain(SALT, tokens, PAGE)
        n = _check_pages(self.store, keys)  # each page read equals the one put
        assert all(k in self.put_keys for k in keys[:n])

    @precondition(lambda self: self.put_keys)
    @rule()
    def restart(self):
        self.store.close()
        self.store = DiskStore(self.dir, budget_bytes=self.budget, min_free_bytes=0)
        assert self.store.stats.set_aside == 0

    @invariant()
    def within_budget_and_reachable(self):
        store = self.store
        store.flush()
        assert store.num_bytes <= self.budget
        entries = dict(store._entries)
        for key, e in entries.items():
            assert self.put_keys.get(key) == e.parent
            assert e.parent == SALT or e.parent in entries, "an unreachable page"

    def teardown(self):
        self.store.close()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


TestDiskMachine = DiskMachine.TestCase
TestDiskMachine.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)
