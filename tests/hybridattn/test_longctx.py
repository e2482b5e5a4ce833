"""Long context: the engine's sizes at up to 1M tokens, the memory report per context length,
and the ``bench longctx`` code path at tiny lengths (the long runs live in the bench)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from harness import CFG, PARAMS

from hybridattn.bench import longctx
from hybridattn.engine import (
    REQ_TABLE_POSITIONS,
    Engine,
    MemoryReport,
    default_max_running_requests,
)
from hybridattn.engine.buckets import kv_ladder
from hybridattn.models.kimi_linear import apply

M1 = 1 << 20


@pytest.fixture(scope="module")
def long_engine():
    """A 1M-context engine over a 4096-slot pool: its pools stay small."""
    return Engine(CFG, PARAMS, max_context_len=M1, num_token_slots=4097, chunk_size=32,
                  chunked_prefill_size=64, token_buckets=(16, 80))


def test_a_1m_context_engine_over_a_small_pool_allocates_one_row_and_serves_short_prompts(
        long_engine):
    eng = long_engine
    # the pool holds no full context, so one row is allocated (not the default 8)
    assert eng.max_running_requests == 1
    assert eng.state.req_to_token_pool.req_to_token.shape == (2, M1)
    assert eng.kv_buckets == kv_ladder(M1) and len(eng.kv_buckets) == 12
    m = eng.memory
    assert 2 * M1 * 4 <= m.req_to_token_bytes < 2 * M1 * 4 + 4096
    assert m.pool_bytes < m.req_to_token_bytes + 4097 * (m.mla_bytes_per_token + 16) + (1 << 20)
    assert sum(x.nbytes for x in jax.tree.leaves(eng.state)) == m.pool_bytes
    outs = eng.generate([[1, 2, 3], list(range(100))], 3)
    assert [len(o) for o in outs] == [3, 3]


def test_a_prompt_that_cannot_fit_names_its_length_the_context_and_the_token_slots(
        long_engine):
    with pytest.raises(ValueError, match=r"prompt 0 of 5000 tokens \+ max_tokens=2 needs "
                       r"a context of 5001 tokens, more than the token pool holds: this engine "
                       r"has max_context_len=1048576 and 4096 token slots"):
        long_engine.generate([[1] * 5000], 2)
    short = Engine(CFG, PARAMS, max_running_requests=2, max_context_len=64, num_token_slots=129,
                   chunked_prefill_size=64, token_buckets=(16, 80))
    with pytest.raises(ValueError, match=r"of 60 tokens \+ max_tokens=8 needs a context of "
                       r"67 tokens, more than max_context_len holds: this engine has "
                       r"max_context_len=64 and 128 token slots"):
        short.add_request([1] * 60, 8)
    assert not long_engine.has_unfinished() and not short.has_unfinished()


def test_default_rows_shrink_at_huge_contexts_so_the_request_table_stays_small():
    assert [default_max_running_requests(n) for n in (96, 4096, 1 << 18)] == [32, 32, 32]
    assert default_max_running_requests(M1) == 8
    assert default_max_running_requests(1 << 30) == 1
    for n in (1 << 18, 1 << 19, M1, 1 << 22):
        assert default_max_running_requests(n) * n <= REQ_TABLE_POSITIONS


def test_a_request_table_larger_than_the_budget_is_refused_before_anything_is_allocated():
    with pytest.raises(ValueError, match=r"mem_fraction=0.5 of the available memory \(\d+ "
                       r"bytes\) holds no req_to_token table of max_running_requests=100000 "
                       r"rows x max_context_len=1048576 int32 positions \(\d+ bytes\): lower "
                       r"max_running_requests \(the default at this context is 8\)"):
        Engine(CFG, PARAMS, max_running_requests=100_000, max_context_len=M1,
               num_token_slots=4097)


def test_the_memory_report_per_context_length_grows_with_the_pools():
    lens = (4096, 1 << 14, 1 << 16, 1 << 18, M1)
    reps = MemoryReport.by_context_len(CFG, lens, max_running_requests=1)
    assert [r.max_context_len for r in reps] == list(lens)
    assert all(r.num_token_slots == n + 1 for r, n in zip(reps, lens, strict=True))
    # tiny: one MLA layer of 32 + 8 float32 per token
    assert {r.mla_bytes_per_token for r in reps} == {160}
    for r, n in zip(reps, lens, strict=True):
        assert 2 * n * 4 <= r.req_to_token_bytes < 2 * n * 4 + 4096
    # per token of context: latents, two table rows and the slot allocator (its free stack,
    # in_use bit and stack_pos: 9 B), the same at every n
    per_token = {(b.pool_bytes - a.pool_bytes) / (b.max_context_len - a.max_context_len)
                 for a, b in zip(reps, reps[1:], strict=False)}
    assert per_token == {160 + 8 + 9}
    params = {r.param_bytes for r in reps}
    assert params == {sum(x.nbytes for x in jax.tree.leaves(PARAMS))}
    rows = [r.max_running_requests for r in MemoryReport.by_context_len(CFG, lens)]
    assert rows == [32, 32, 32, 32, 8]
    table = MemoryReport.format_table(reps).splitlines()
    assert len(table) == 1 + len(lens) and table[-1].split()[0] == str(M1)


def test_bench_longctx_runs_each_length_in_its_own_process(tmp_path, capsys):
    res = longctx.bench_longctx(lengths=[256, 512], new_tokens=3, mla_rounds=1)
    assert [r["prompt_len"] for r in res["rows"]] == [256, 512]
    for r in res["rows"]:
        assert "failed" not in r, r
        assert len(r["tokens"]) == 3
        assert r["prefill_compiled"] == 0  # every shape compiled before the timed prefill
        assert r["decode_steps"] == 2 and r["decode_step_s"] > 0
        assert r["decode_floor_s"] > 0 and r["decode_floor_ratio"] > 0
        assert 0 < r["mla_prefill_s"] and 0 < r["mla_decode_s"]
        assert r["peak_prefill_rss_bytes"] >= r["prefill_alone_peak_rss_bytes"] > 0
        assert r["pool_bytes"] > 0 and r["param_bytes"] > 0
    assert "peak_linear_in_pools" in res["verdict"]
    longctx.print_longctx(res)
    out = capsys.readouterr().out
    assert "target 64k prefill" in out and "   512 |" in out
    pytest.importorskip("matplotlib")
    from hybridattn.bench.plots import plot_longctx

    assert plot_longctx(res, str(tmp_path)).endswith("longctx.png")


def test_compare_chunk_reruns_each_length_with_the_other_chunk_and_compares_tokens(
        monkeypatch, capsys):
    """The parent side of ``--compare-chunk`` (the children are the run above's): a second
    child per length with the other chunk, its tokens set against the first's."""
    runs = []

    def child(n, new_tokens, chunk, mla_rounds, timeout_s):
        runs.append((n, chunk))
        if n == 300 and chunk == 64:
            return dict(prompt_len=n, failed="exit 1: boom")
        tokens = [1, 2] if (n, chunk) != (200, 64) else [1, 3]
        figures = dict.fromkeys(("wall_prefill_s", "compile_s", "prefill_tok_s",
                                 "mla_prefill_share", "peak_prefill_rss_bytes",
                                 "prefill_alone_peak_rss_bytes", "base_rss_bytes",
                                 "pool_bytes", "param_bytes", "mla_decode_share"), 1)
        return dict(figures, prompt_len=n, chunked_prefill_size=chunk or 256, tokens=tokens,
                    decode_step_s=None)

    monkeypatch.setattr(longctx, "_longctx_child", child)
    res = longctx.bench_longctx(lengths=[100, 200, 300], new_tokens=2, compare_chunk=64)
    assert runs == [(100, None), (100, 64), (200, None), (200, 64), (300, None), (300, 64)]
    got = [r["compare_chunk"] for r in res["rows"]]
    assert [c["same_tokens"] for c in got] == [True, False, False]
    assert got[2]["failed"] == "exit 1: boom"
    longctx.print_longctx(res)
    out = capsys.readouterr().out
    assert "100 tokens, chunked_prefill_size 256 vs 64: same greedy tokens" in out
    assert "200 tokens, chunked_prefill_size 256 vs 64: DIFFERENT tokens" in out
    assert "300 tokens, chunked_prefill_size 256 vs 64: failed (exit 1: boom)" in out


def test_an_8k_prompt_gives_the_greedy_tokens_of_the_dense_apply():
    """The engine at 8k (blockwise MLA over the paged pool, chunked prefill) against the
    cache-free dense ``apply``: each generated token is ``apply``'s argmax after the prompt
    and the tokens before it (one teacher-forced ``apply`` over prompt + answer)."""
    n, new = 8192, 4
    prompt = np.random.default_rng(8).integers(1, CFG.vocab_size, n).tolist()
    eng = Engine(CFG, PARAMS, max_running_requests=1, max_context_len=n + new,
                 num_token_slots=n + new + 1, chunk_size=32, prefix_cache=False,
                 chunked_prefill_size=2048, token_buckets=(2049,), kv_buckets=(n + new,),
                 request_buckets=(1,))
    (answer,) = eng.generate([prompt], new)
    logits = jax.jit(apply, static_argnums=1)(PARAMS, CFG, np.array([prompt + answer[:-1]]))
    want = np.asarray(logits[0, n - 1:].argmax(-1)).tolist()
    assert answer == want
