"""The prefix cache's disk tier (``Engine(cache_dir=...)``, ``mlxcache.engine._disk``) on real
checkpoint directories, real processes and a real file system.

The oracle is mlx-lm's own greedy decoding (``zoo.reference_generate``, its caches from token
0): whatever came back from disk, an engine's tokens equal a cold run's, token for token. A
prefix written under another model, weights, dtype or tokenizer is never read back.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import threading

import mlx.core as mx
import mlx_lm
import pytest

from mlxcache import Engine, zoo
from servecore.diskcache import DirectoryInUse, DiskStore
from servecore.testing import word_tokenizer

pytestmark = pytest.mark.mlx

FAMILIES = ["llama", "qwen3_next", "gemma3_text"]  # KVCache; hybrid; sliding window
MAX = 6


def _cold(model, prompt: list[int]) -> list[int]:
    """mlx-lm's greedy tokens, up to the word tokenizer's EOS (id 1) as an engine stops."""
    out = zoo.reference_generate(model, prompt, MAX)
    return out[: out.index(1) + 1] if 1 in out else out


def _prompt(seed: int, n: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, zoo.VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    for family in FAMILIES:
        zoo.save_checkpoint(family, root / family)
    return root


def _write_in_a_process(model_dir, cache_dir, prompt) -> None:
    """A process that loads the directory, serves ``prompt`` with the disk tier, closes."""
    script = textwrap.dedent(f"""
        import mlx_lm
        from mlxcache import Engine
        model, tok = mlx_lm.load({str(model_dir)!r})
        with Engine(model, tok, num_slots=1024, cache_dir={str(cache_dir)!r}) as e:
            e.generate([{prompt!r}], max_tokens={MAX})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_new_process_finds_the_prefix_and_decodes_as_a_cold_run(checkpoints, tmp_path,
                                                                   family):
    prompt = _prompt(1)
    _write_in_a_process(checkpoints / family, tmp_path, prompt)
    model, tok = mlx_lm.load(str(checkpoints / family))
    want = _cold(model, prompt + [7])
    with Engine(model, tok, num_slots=1024, cache_dir=tmp_path) as engine:
        # a longer prompt, the written one a prefix of it: its pages come from disk
        assert engine.generate([prompt + [7]], max_tokens=MAX)[0] == want
        s = engine.stats
        assert s.disk_hits == 1 and s.cached_tokens == s.disk_tokens_read == 256
        assert s.disk.pages_read >= 1 and s.disk.set_aside == 0  # (a state is an entry too)


def test_other_weights_dtype_tokenizer_or_model_read_nothing(checkpoints, tmp_path):
    prompt = _prompt(2)
    _write_in_a_process(checkpoints / "llama", tmp_path, prompt)
    model, tok = mlx_lm.load(str(checkpoints / "llama"))

    def served(m, t=tok):
        with Engine(m, t, num_slots=1024, cache_dir=tmp_path, disk_budget=1 << 26) as e:
            out = e.generate([prompt], max_tokens=MAX)[0]
            assert e.stats.disk_hits == 0 and e.stats.cached_tokens == 0
            return out

    # another tokenizer (one word fewer), the same weights
    assert served(model, word_tokenizer(zoo.VOCAB - 1)) == _cold(model, prompt)
    # another model on the same directory
    other, other_tok = mlx_lm.load(str(checkpoints / "gemma3_text"))
    assert served(other, other_tok) == _cold(other, prompt)
    # one weight of one tensor changed
    w = model.layers[0].mlp.down_proj.weight
    model.layers[0].mlp.down_proj.weight = w + mx.where(mx.arange(w.size).reshape(w.shape) == 0,
                                                        0.5, 0.0).astype(w.dtype)
    mx.eval(model.parameters())
    assert served(model) == _cold(model, prompt)
    # another dtype
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    assert served(model) == _cold(model, prompt)


def test_a_snapshot_grid_the_disk_pages_miss_is_refused_by_name(tmp_path):
    """A hybrid model's disk page is read back only with the state at its end: a grid that
    never lands there would write every page and read none, so the engine refuses it."""
    with pytest.raises(ValueError, match="snapshot_interval=96 does not divide the disk"):
        Engine(zoo.make("qwen3_next"), num_slots=512, snapshot_interval=96, cache_dir=tmp_path)
    with Engine(zoo.make("qwen3_next"), num_slots=512, snapshot_interval=64,
                cache_dir=tmp_path) as engine:  # 64 divides 256: served
        engine.generate([[5, 6, 7]], 2)
    with Engine(zoo.make("llama"), num_slots=512, snapshot_interval=96, cache_dir=tmp_path):
        pass  # no recurrent layers: the grid is unused (a warning says so)


@pytest.mark.parametrize("how", ["dropped", "left open at exit"])
def test_an_engine_never_closed_still_spills_and_unlocks(checkpoints, tmp_path, how):
    """An engine dropped without ``close()`` closes as it goes (spill, unlock: a new engine
    in the same process owns the directory); one left open when the process exits spills
    too: a new process finds its prefix."""
    prompt = _prompt(5)
    script = textwrap.dedent(f"""
        import gc, mlx_lm
        from mlxcache import Engine
        model, tok = mlx_lm.load({str(checkpoints / "llama")!r})
        e = Engine(model, tok, num_slots=1024, cache_dir={str(tmp_path)!r})
        e.generate([{prompt!r}], max_tokens={MAX})
        if {how == "dropped"!r}:
            del e
            gc.collect()
            with Engine(model, tok, num_slots=1024, cache_dir={str(tmp_path)!r}) as again:
                again.generate([{prompt!r}], max_tokens={MAX})
                assert again.stats.disk_hits == 1, again.stats
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    model, tok = mlx_lm.load(str(checkpoints / "llama"))
    with Engine(model, tok, num_slots=1024, cache_dir=tmp_path) as e:
        assert e.generate([prompt], max_tokens=MAX)[0] == _cold(model, prompt)
        assert e.stats.disk_hits == 1


def test_another_mlx_lm_version_reads_nothing(checkpoints, tmp_path, monkeypatch):
    """mlx-lm's model code computes the K/V: pages written under one version are misses
    under another, as under other weights."""
    prompt = _prompt(3)
    _write_in_a_process(checkpoints / "llama", tmp_path, prompt)
    model, tok = mlx_lm.load(str(checkpoints / "llama"))
    monkeypatch.setattr(mlx_lm, "__version__", "0.0.1")
    with Engine(model, tok, num_slots=1024, cache_dir=tmp_path) as e:
        assert e.generate([prompt], max_tokens=MAX)[0] == _cold(model, prompt)
        assert e.stats.disk_hits == 0 and e.stats.cached_tokens == 0


def test_reset_cache_forgets_the_models_pages_on_disk_too(checkpoints, tmp_path):
    """After ``reset_cache`` nothing cached is served, from memory or from the directory
    (weights changed in place would otherwise be answered from the old pages); another
    model's pages in the directory stay."""
    prompt = _prompt(4)
    _write_in_a_process(checkpoints / "gemma3_text", tmp_path, prompt)  # another model's
    _write_in_a_process(checkpoints / "llama", tmp_path, prompt)
    model, tok = mlx_lm.load(str(checkpoints / "llama"))
    with Engine(model, tok, num_slots=1024, cache_dir=tmp_path) as e:
        held = e.core.disk.disk.num_pages
        e.reset_cache()
        assert 0 < e.core.disk.disk.num_pages < held  # the other model's pages stay
        assert e.generate([prompt], max_tokens=MAX)[0] == _cold(model, prompt)
        assert e.stats.disk_hits == 0 and e.stats.cached_tokens == 0
    with Engine(model, tok, num_slots=1024, cache_dir=tmp_path) as e:  # what close spilled
        e.generate([prompt], max_tokens=MAX)
        assert e.stats.disk_hits == 1
        # weights changed in place, then reset: what is spilled after is filed under them
        w = model.layers[0].mlp.down_proj.weight
        model.layers[0].mlp.down_proj.weight = w * 1.5
        mx.eval(model.parameters())
        e.reset_cache()
        assert e.generate([prompt], max_tokens=MAX)[0] == _cold(model, prompt)
    model.layers[0].mlp.down_proj.weight = w  # the original weights: nothing of the others'
    with Engine(model, tok, num_slots=1024, cache_dir=tmp_path) as e:
        assert e.generate([prompt], max_tokens=MAX)[0] == _cold(model, prompt)
        assert e.stats.disk_hits == 0


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_a_prefix_evicted_from_memory_comes_back_from_disk(checkpoints, tmp_path, family):
    """A pool of 700 slots: three 300-token prompts evict the first, which then reloads."""
    model, tok = mlx_lm.load(str(checkpoints / family))
    prompts = [_prompt(10 + i) for i in range(3)]
    with Engine(model, tok, num_slots=700, cache_dir=tmp_path) as engine:
        for p in prompts:
            engine.generate([p], max_tokens=MAX)
        engine.core.disk.disk.flush()  # spills are written on the writer thread: wait for it
        assert engine.stats.token_evictions > 0 and engine.stats.disk.pages_written > 0
        again = prompts[0] + [5, 6]
        assert engine.generate([again], max_tokens=MAX)[0] == _cold(model, again)
        assert engine.stats.disk_hits == 1 and engine.stats.disk_tokens_read == 256


def test_damaged_pages_are_misses_and_a_second_engine_is_refused(checkpoints, tmp_path):
    prompt = _prompt(3, 800)
    _write_in_a_process(checkpoints / "llama", tmp_path, prompt)
    pages = sorted((tmp_path / "pages").iterdir(), key=lambda p: p.stat().st_mtime_ns)
    assert len(pages) == 3  # 799 usable tokens: 3 whole pages of 256
    data = pages[2].read_bytes()
    pages[2].write_bytes(data[:-10])  # the third page truncated
    (tmp_path / "pages" / ".junk.tmp").write_bytes(b"half")  # a stale temporary file
    model, tok = mlx_lm.load(str(checkpoints / "llama"))
    with Engine(model, tok, num_slots=1024, cache_dir=tmp_path) as engine:
        with pytest.raises(DirectoryInUse, match="in use by another engine"):
            Engine(model, tok, num_slots=1024, cache_dir=tmp_path)
        assert engine.generate([prompt], max_tokens=MAX)[0] == _cold(model, prompt)
        s = engine.stats
        assert s.disk.set_aside >= 2 and s.disk_tokens_read == 2 * 256  # the pages before it
    with pytest.raises(ValueError, match="cache_dir=.*needs the prefix cache"):
        Engine(model, tok, prefix_cache=False, cache_dir=tmp_path)
    Engine(model, tok, num_slots=1024, cache_dir=tmp_path).close()  # the lock was released


def test_a_long_session_with_a_small_disk_budget_stays_within_it(checkpoints, tmp_path):
    model, tok = mlx_lm.load(str(checkpoints / "llama"))
    budget = 600_000  # four pages of this llama
    with Engine(model, tok, num_slots=700, cache_dir=tmp_path, disk_budget=budget,
                disk_min_free=0) as engine:
        for i in range(10):
            engine.generate([_prompt(100 + i, 300)], max_tokens=2)
            engine.core.disk.disk.flush()
            held = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
            assert held <= budget, (i, held)
        assert engine.stats.disk.pages_evicted > 0


def test_a_request_waiting_for_its_pages_does_not_hold_the_others(checkpoints, tmp_path,
                                                                   monkeypatch):
    """The reader thread is held until the running request has finished: that request
    decodes to its end meanwhile, then the waiting one gets its pages and decodes as a cold
    run."""
    prompt = _prompt(4)
    _write_in_a_process(checkpoints / "llama", tmp_path, prompt)
    model, tok = mlx_lm.load(str(checkpoints / "llama"))
    gate = threading.Event()
    real = DiskStore._read

    def held(self, *args):
        assert gate.wait(60)
        return real(self, *args)

    monkeypatch.setattr(DiskStore, "_read", held)
    other = _prompt(5, 40)
    with Engine(model, tok, num_slots=1024, cache_dir=tmp_path) as engine:
        first = engine.add_request(other, max_tokens=MAX)
        got: dict[int, list[int]] = {first: []}
        done = set()
        for rid, token, _ in engine.step():  # its first token: it is running
            got[rid].append(token)
        waiting = engine.add_request(prompt, max_tokens=MAX)
        got[waiting] = []
        while first not in done:
            for rid, token, finished in engine.step():
                got[rid].append(token)
                done |= {rid} if finished else set()
        assert waiting not in done and not got[waiting]  # still reading
        gate.set()
        while waiting not in done:
            for rid, token, finished in engine.step():
                got[rid].append(token)
                done |= {rid} if finished else set()
        assert got[waiting] == _cold(model, prompt) and engine.stats.disk_hits == 1
        assert got[first] == _cold(model, other)
