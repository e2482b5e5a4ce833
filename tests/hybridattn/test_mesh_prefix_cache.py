"""The prefix cache on a mesh: each data shard keeps its own radix tree over its own token
and snapshot slots (``ShardedScheduler``), and admission routes a request to the shard that
holds its longest prefix. On 8 CPU devices (``conftest.py``), a (2, 4) mesh.

The oracles: the one-device engine with the prefix cache and the one-device engine without
it (every prompt from token 0), serving the same requests; tokens must be equal.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from harness import assert_whole

from hybridattn import mesh as MS
from hybridattn.config import KimiLinearConfig
from hybridattn.models import kimi_linear

# as test_sharding.py: 2 layers (KDA + dense MLP, MLA + MoE of 8 experts), 8 heads each
CFG = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64,
                            linear_num_heads=8, linear_head_dim=8, num_attention_heads=8,
                            num_experts=8, intermediate_size=64, moe_intermediate_size=16)
L = 48
GEO = dict(max_context_len=L, chunked_prefill_size=8, chunk_size=8, token_buckets=(12,),
           kv_buckets=(L,))


@pytest.fixture(scope="module")
def engines():
    """One device without and with the prefix cache; a 2x4 mesh with it (the default), 2
    rows and 2 contexts of token slots per data shard."""
    from hybridattn.engine import Engine

    params = kimi_linear.init_params(CFG, jax.random.key(0))
    cold = Engine(CFG, params, num_token_slots=4 * L + 1, max_running_requests=4,
                  request_buckets=(4,), prefix_cache=False, **GEO)
    one = Engine(CFG, params, num_token_slots=4 * L + 1, max_running_requests=4,
                 request_buckets=(4,), num_snapshot_slots=24, snapshot_interval=8, **GEO)
    mesh = Engine(CFG, params, num_token_slots=2 * (2 * L + 1), max_running_requests=4,
                  request_buckets=(2,), num_snapshot_slots=2 * 12, snapshot_interval=8,
                  mesh=MS.make_mesh(2, 4), **GEO)
    assert mesh.prefix_cache and len(mesh.tree) == 2
    return cold, one, mesh


def _words(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(1, CFG.vocab_size, n).tolist()


def test_shared_prompts_turns_and_siblings_equal_one_device(engines):
    """Two system prompts, siblings under each, then two more turns of every conversation:
    the mesh's tokens equal one device's with the cache and without it; each shard's tree
    serves hits; nothing leaks."""
    cold, one, mesh = engines
    rng = np.random.default_rng(3)
    systems = [_words(rng, 14), _words(rng, 11)]
    prompts = [systems[i % 2] + _words(rng, 2 + i) for i in range(6)]
    for turn in range(3):
        want = cold.generate(prompts, 3)
        assert one.generate(prompts, 3) == want, turn
        assert mesh.generate(prompts, 3) == want, turn
        prompts = [p + out + _words(rng, 2) for p, out in zip(prompts, want, strict=True)]
    s = mesh.stats
    assert s.cached_tokens > 0 and all(rate > 0 for rate in s.shard_hit_rates), \
        s.shard_hit_rates
    assert sum(s.shard_cached_tokens) == s.cached_tokens
    assert all(tree.total_size > 0 for tree in mesh.tree)
    assert_whole(mesh)


def test_a_prefix_on_a_full_shard_is_served_right_on_another(engines):
    """A shard whose rows are all taken cannot admit the request that its tree would serve
    best: the request runs on the other shard, from token 0 there, and its tokens are
    right."""
    cold, _, mesh = engines
    rng = np.random.default_rng(4)
    system = _words(rng, 20)
    mesh.generate([system], 1)  # now one shard's tree holds it, with a state at its end
    [home] = [k for k, tree in enumerate(mesh.tree) if tree.peek(system)[1] == len(system)]
    blockers = [system + _words(rng, 3) for _ in range(2)]  # routed home, fill its 2 rows
    late = system + _words(rng, 4)
    rids = [mesh.add_request(p, 12) for p in blockers] + [mesh.add_request(late, 3)]
    got = {rid: [] for rid in rids}
    shard_of = {}
    while mesh.has_unfinished():
        for rid, tok, _ in mesh.step():
            got[rid].append(tok)
        for r in mesh.core.scheduler.running:
            shard_of.setdefault(r.rid, r.shard)
    assert [shard_of[rid] for rid in rids[:2]] == [home, home]
    assert shard_of[rids[2]] == 1 - home
    assert [got[rid] for rid in rids] == cold.generate(blockers + [late], [12, 12, 3])
    assert_whole(mesh)
