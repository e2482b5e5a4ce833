"""The sharded serving step (``hybridattn.sharding``) against the unsharded one, on 8 CPU
devices (``conftest.py``).

A sharded state is ``D`` single-device states stacked over ``data``; the reference for data
shard ``k`` is the ordinary ``serving.step`` run on one device with shard ``k``'s requests in
a state of shard ``k``'s size. Every mesh keeps 2 request rows and 32 token slots per data
shard, so the reference compiles once for the whole module.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import assert_whole

from hybridattn import mesh as MS
from hybridattn import sharding as S
from hybridattn.backends import ForwardMode
from hybridattn.config import KimiLinearConfig
from hybridattn.models import kimi_linear
from hybridattn.models.kimi_linear import partitioning as PR
from hybridattn.pools import alloc_reqs_or_raise
from hybridattn.serving import ServingState, WorkItem, make_worker_batch, step

# 2 layers: 0 KDA + dense MLP, 1 MLA + MoE (8 experts, top-2, one shared); 8 heads each.
CFG = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64,
                            linear_num_heads=8, linear_head_dim=8, num_attention_heads=8,
                            num_experts=8, intermediate_size=64, moe_intermediate_size=16)
ROWS, SLOTS, L = 2, 32, 16  # per data shard
PREFILL = dict(vocab_size=64, max_context_len=L, num_requests=ROWS, num_tokens=8, kv_width=L,
               max_extend_len=8)
DECODE = dict(vocab_size=64, max_context_len=L, num_requests=ROWS, num_tokens=ROWS,
              kv_width=L, max_extend_len=1, forward_mode=ForwardMode.DECODE)
MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]


@pytest.fixture(scope="module")
def params():
    return kimi_linear.init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def ref_step():
    return jax.jit(step, donate_argnums=1)


def _prompts(k):
    """Shard ``k``'s prompts: two on even shards, one on odd ones (uneven on purpose)."""
    first = [(3 * k + j) % 60 + 1 for j in range(2 + k % 3)]
    return [first, [7, (k + 5) % 60 + 1]] if k % 2 == 0 else [first]


def _ref_state(n):
    state = ServingState.create(CFG, max_running_requests=ROWS, max_context_len=L,
                                num_token_slots=SLOTS)
    pool, _ = alloc_reqs_or_raise(state.req_to_token_pool, n)
    return state.replace(req_to_token_pool=pool)


def _sharded(mesh_shape, params):
    mesh = MS.make_mesh(*mesh_shape)
    D = mesh_shape[0]
    run = S.ShardedStep(CFG, mesh, logits=True)
    state = ServingState.create(CFG, max_running_requests=ROWS * D, max_context_len=L,
                                num_token_slots=SLOTS * D, mesh=mesh)
    return mesh, run, S.shard_params(params, CFG, mesh), state


def _close(a, b, what, tol=1e-5):
    err = float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
    assert err <= tol, f"{what}: max |sharded - unsharded| = {err:.3g}"


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_sharded_prefill_and_decodes_equal_the_unsharded_step(mesh_shape, params, ref_step):
    D, tensor = mesh_shape
    mesh, run, sp, state = _sharded(mesh_shape, params)
    prompts = [_prompts(k) for k in range(D)]
    state, rows = run.alloc_rows(state, [len(p) for p in prompts])
    assert rows == [list(range(1, len(p) + 1)) for p in prompts]  # local ids, per shard
    refs = [_ref_state(len(p)) for p in prompts]
    items = [[WorkItem(r, 0, ids) for r, ids in zip(rows[k], prompts[k], strict=True)]
             for k in range(D)]
    lens = [[len(ids) for ids in p] for p in prompts]
    batch = run.make_batch(items, **PREFILL)
    ref_batches = [make_worker_batch(it, **PREFILL) for it in items]
    for n in range(4):  # one prefill, three decodes
        state, out = run(sp, state, batch)
        assert np.asarray(out.ok).all()
        tokens, logits = np.asarray(out.next_token_ids), np.asarray(out.logits)
        for k in range(D):
            refs[k], ref = ref_step(params, refs[k], ref_batches[k])
            live = len(prompts[k])
            _close(logits[k, :live], ref.logits[:live], f"step {n} shard {k} logits")
            assert tokens[k].tolist() == np.asarray(ref.next_token_ids).tolist()
        items = [[WorkItem(r, lens[k][j], [int(tokens[k, j])])
                  for j, r in enumerate(rows[k])] for k in range(D)]
        lens = [[m + 1 for m in ls] for ls in lens]
        batch = run.make_batch(items, **DECODE)
        ref_batches = [make_worker_batch(it, **DECODE) for it in items]
    pools, kv = state.recurrent_state_pool, state.token_to_kv_pool
    for k in range(D):
        _close(np.asarray(pools.ssm)[k], refs[k].recurrent_state_pool.ssm, f"shard {k} KDA state")
        _close(S.natural_conv(jnp.asarray(np.asarray(pools.conv)[k]), tensor),
               refs[k].recurrent_state_pool.conv, f"shard {k} conv state")
        _close(np.asarray(kv.c_kv)[k], refs[k].token_to_kv_pool.c_kv, f"shard {k} c_kv")
        _close(np.asarray(kv.k_pe)[k], refs[k].token_to_kv_pool.k_pe, f"shard {k} k_pe")
        assert np.array_equal(np.asarray(state.req_to_token_pool.req_to_token)[k],
                              refs[k].req_to_token_pool.req_to_token)


def _collectives(hlo: str) -> dict[str, list[str]]:
    """Result shapes of each collective op in an HLO module's text."""
    found: dict[str, list[str]] = {}
    for m in re.finditer(r"= (\S+?) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(-start)?\(", hlo):
        found.setdefault(m.group(2), []).append(m.group(1))
    return found


def test_the_2x4_step_keeps_shardings_and_holds_only_activation_collectives(params):
    mesh, run, sp, state = _sharded((2, 4), params)
    state, rows = run.alloc_rows(state, [2, 1])
    batch = run.make_batch([[WorkItem(1, 0, [1, 2, 3]), WorkItem(2, 0, [4])],
                            [WorkItem(1, 0, [5, 6])]], **PREFILL)
    before = [x.sharding for x in jax.tree.leaves(state)]
    hlo = run.lower(sp, state, batch).compile().as_text()
    new, out = run(sp, state, batch)
    assert [x.sharding for x in jax.tree.leaves(new)] == before  # donation can reuse buffers
    assert out.next_token_ids.sharding.spec == MS.BATCH_SPEC
    ops = _collectives(hlo)
    # KDA o_proj, dense MLP, MLA o_proj, routed experts (over tensor), shared experts: one
    # all-reduce each (XLA may merge some); the MoE gathers tokens / routes over data and
    # scatters the expert sums back. Nothing else.
    assert 1 <= len(ops.get("all-reduce", [])) <= 5, ops
    assert 1 <= len(ops.get("all-gather", [])) <= 3, ops
    assert len(ops.get("reduce-scatter", [])) == 1, ops
    assert "all-to-all" not in ops
    T_all = 2 * PREFILL["num_tokens"]  # every data shard's tokens
    for shape in ops["all-gather"]:  # activations only: never a pool or a weight
        dims = [int(d) for d in re.findall(r"\d+", shape.split("[")[1].split("]")[0])]
        assert dims[0] == T_all and np.prod(dims) <= T_all * CFG.hidden_size, shape


def test_the_2x4_step_lowers_to_the_collectives_of_each_layer(params):
    """Before XLA combines independent all-reduces, the program holds exactly the planned
    collectives, layer by layer (``sharding.MeshComm``): one all-reduce over tensor for each
    attention layer's row-parallel ``o_proj`` and for each dense MLP or shared expert; per MoE
    layer three all-gathers over data (tokens, expert ids, weights), one reduce-scatter back
    and one all-reduce of the experts' shares over tensor."""
    mesh, run, sp, state = _sharded((2, 4), params)
    state, _ = run.alloc_rows(state, [2, 1])
    batch = run.make_batch([[WorkItem(1, 0, [1, 2, 3]), WorkItem(2, 0, [4])],
                            [WorkItem(1, 0, [5, 6])]], **PREFILL)
    text = run.lower(sp, state, batch).as_text()
    sparse = sum(t == "sparse" for t in CFG.mlp_layer_types)
    dense = len(CFG.mlp_layer_types) - sparse
    shared = sparse if CFG.num_shared_experts else 0
    want = {"all_reduce": CFG.num_hidden_layers + dense + shared + sparse,
            "all_gather": 3 * sparse, "reduce_scatter": sparse, "all_to_all": 0,
            "collective_permute": 0}
    got = {op: len(re.findall(rf"stablehlo\.{op}\b", text)) for op in want}
    assert got == want


def _per_device_bytes(tree, device):
    total = per = 0
    for x in jax.tree.leaves(tree):
        total += x.nbytes
        per += sum(s.data.nbytes for s in x.addressable_shards if s.device == device)
    return total, per


def test_per_device_bytes_follow_the_table(params):
    mesh, run, sp, state = _sharded((2, 4), params)
    dev = mesh.devices.flat[0]
    # KDA states: split over all 8 devices; MLA latents: over data only (no head axis)
    pools = state.recurrent_state_pool
    total, per = _per_device_bytes(pools.ssm, dev)
    assert per * 8 == total
    total, per = _per_device_bytes(state.token_to_kv_pool, dev)
    assert per * 2 == total
    # params: each leaf's shard is its size over the mesh axes its spec names
    specs = PR.param_specs(CFG, mesh)
    want = 0
    for x, spec in zip(jax.tree.leaves(sp), jax.tree.leaves(specs, is_leaf=MS.is_spec),
                       strict=True):
        axes = [a for p in spec for a in ((p,) if isinstance(p, str) else (p or ()))]
        want += x.nbytes // int(np.prod([mesh.shape[a] for a in axes]))
    total, per = _per_device_bytes(sp, dev)
    assert per == want
    experts = [x for path, x in jax.tree_util.tree_leaves_with_path(sp)
               if "experts" in jax.tree_util.keystr(path) and "shared" not in
               jax.tree_util.keystr(path)]
    e_total, e_per = _per_device_bytes(experts, dev)
    assert e_per * 8 == e_total


def test_padding_and_an_unbalanced_batch_leave_other_shards_bit_for_bit(params):
    """Every live request on data shard 0; shards 1-3 run padding only. Their pools, tables
    and allocators are unchanged bit for bit but for their own slot-0 sinks, which only their
    own padding rows touch."""
    mesh, run, sp, state = _sharded((4, 2), params)
    state, rows = run.alloc_rows(state, [2, 1, 0, 1])
    first = run.make_batch([[WorkItem(1, 0, [1, 2, 3])], [WorkItem(1, 0, [4, 5])], [],
                            [WorkItem(1, 0, [9])]], **PREFILL)
    state, _ = run(sp, state, first)
    host = lambda st: [np.asarray(x) for x in jax.tree.leaves(st.replace(rng=None))]
    before = host(state)
    batch = run.make_batch([[WorkItem(1, 3, [7]), WorkItem(2, 0, [8, 9, 10])], [], [], []],
                           **PREFILL)
    state, out = run(sp, state, batch)
    assert np.asarray(out.ok).all()
    after = host(state)
    names = [jax.tree_util.keystr(p)
             for p, _ in jax.tree_util.tree_leaves_with_path(state.replace(rng=None))]
    changed0 = False
    for name, b, a in zip(names, before, after, strict=False):
        changed0 |= not np.array_equal(a[0], b[0])
        for k in (1, 2, 3):
            if any(pool in name for pool in ("kv_pool", "state_pool")):
                a_k, b_k = a[k][1:], b[k][1:]  # slot 0 is the shard's own sink
            else:
                a_k, b_k = a[k], b[k]
            assert np.array_equal(a_k, b_k), f"{name} of data shard {k} changed"
    assert changed0


def test_divisibility_errors_name_the_count():
    with pytest.raises(ValueError, match=r"linear_num_heads=6 is not divisible by the mesh's "
                                         r"tensor size 4"):
        S.ShardedStep(KimiLinearConfig.tiny(linear_num_heads=6, num_attention_heads=8,
                                            num_experts=8), MS.make_mesh(2, 4))
    with pytest.raises(ValueError, match=r"num_experts=4 is not divisible by the mesh's "
                                         r"data\*tensor size 8"):
        PR.param_specs(KimiLinearConfig.tiny(linear_num_heads=8, num_attention_heads=8),
                      MS.make_mesh(2, 4))
    with pytest.raises(ValueError, match=r"max_running_requests=3 is not divisible by the "
                                         r"mesh's data size 2"):
        ServingState.create(CFG, max_running_requests=3, max_context_len=8,
                            num_token_slots=32, mesh=MS.make_mesh(2, 4))
    with pytest.raises(ValueError, match=r"mesh axes are \('x',\)"):
        MS.mesh_sizes(jax.make_mesh((2,), ("x",)))


def test_load_places_each_tensor_with_its_sharding(params, tmp_path):
    kimi_linear.save_pretrained(params, CFG, tmp_path)
    mesh = MS.make_mesh(2, 4)
    _, loaded = kimi_linear.load(tmp_path, mesh=mesh)
    want = PR.param_shardings(CFG, mesh)
    for got, sh, ref in zip(jax.tree.leaves(loaded), jax.tree.leaves(want),
                            jax.tree.leaves(params), strict=True):
        assert got.sharding == sh
        assert np.array_equal(np.asarray(got), np.asarray(ref))


# --------------------------------------------------------------------------------------------
# the engine on a mesh
# --------------------------------------------------------------------------------------------

# 2 rows and 48 token slots (two full contexts) per data shard; the unsharded reference has
# the same totals in one pool. A shard's batch: 2 requests, a prompt chunk of 8 + 2 decodes.
EL = 24
ENGINE = dict(max_context_len=EL, max_running_requests=4, chunked_prefill_size=8,
              chunk_size=8, token_buckets=(12,), kv_buckets=(EL,))


@pytest.fixture(scope="module")
def engines(params):
    """The unsharded engine and the same engine on a 2x4 mesh (each compiles its own step),
    both without the prefix cache (the cached mesh engine: ``test_mesh_prefix_cache.py``)."""
    from hybridattn.engine import Engine

    ref = Engine(CFG, params, num_token_slots=97, request_buckets=(4,), prefix_cache=False,
                 **ENGINE)
    eng = Engine(CFG, params, num_token_slots=2 * 49, request_buckets=(2,),
                 mesh=MS.make_mesh(2, 4), prefix_cache=False, **ENGINE)
    assert (eng.max_running_requests, eng.capacity, eng.shard_capacity) == (4, 96, 48)
    assert eng.prefix_cache is False and eng.tree is None
    return ref, eng


def _workload():
    rng = np.random.default_rng(7)
    lens = [3, 12, 7, 20, 1, 9, 15, 5, 11, 2]  # 20: three prefill chunks
    news = [5, 3, 8, 2, 6, 4, 7, 9, 1, 6]
    return [rng.integers(0, 64, n).tolist() for n in lens], news


def _serve(eng, requests):
    """Serve ``(prompt, max_tokens, kwargs)`` requests, half queued first and the rest
    after two rounds; returns each request's tokens, whether any waited and the data shards
    that ran requests."""
    out, rid_of, waited, shards = {}, {}, False, set()
    half = len(requests) // 2
    for i, (p, n, kw) in enumerate(requests[:half]):
        rid_of[eng.add_request(p, n, **kw)] = i
    rounds = 0
    while eng.has_unfinished() or rounds < 2:
        if rounds == 2:
            for i, (p, n, kw) in enumerate(requests[half:], half):
                rid_of[eng.add_request(p, n, **kw)] = i
        waited |= eng.num_waiting > 0
        shards |= {r.shard for r in eng.scheduler.running}
        for rid, tok, _ in eng.step():
            out.setdefault(rid_of[rid], []).append(tok)
        rounds += 1
    return [out.get(i, []) for i in range(len(requests))], waited, shards


def test_engine_on_a_2x4_mesh_equals_the_unsharded_engine(engines):
    """A mixed workload (prompt lengths 1 to 20 with chunked prefill, more requests than
    rows, late arrivals, stop tokens, max_tokens from 1 to 9, a seeded sampled request):
    the sharded engine's tokens equal the unsharded engine's."""
    ref, eng = engines
    prompts, news = _workload()
    free = {i: ref.generate([prompts[i]], news[i])[0] for i in (1, 6)}
    stops = {1: free[1][1], 6: free[6][3]}  # requests 1 and 6 end early on a stop token
    requests = [(p, n, dict(stop_token_ids=[stops[i]]) if i in stops else {})
                for i, (p, n) in enumerate(zip(prompts, news, strict=True))]
    requests[4] = (prompts[4], news[4], dict(temperature=0.8, seed=3))
    want, ref_waited, _ = _serve(ref, requests)
    got, waited, shards = _serve(eng, requests)
    assert got == want
    assert waited and ref_waited and shards == {0, 1}
    assert [len(g) for g in got] == [n if i not in stops else free[i].index(stops[i]) + 1
                                     for i, n in enumerate(news)]
    assert eng.num_running == eng.num_waiting == 0
    assert eng.num_free_slots == eng.capacity  # every slot of both shards came back
    assert_whole(eng)  # ... to the host, which owns the ids, and to each shard's allocator
    # one compilation per step bucket, plus the row allocation and the release
    s = eng.stats
    assert s.num_compilations <= len(s.buckets) + 2
    assert {m for m, *_ in s.buckets} == {1, 2}  # EXTEND (decodes riding along) and DECODE


def test_continuous_batching_on_a_2x4_mesh_equals_serving_alone(engines):
    """test_serving's continuous-batching check on the mesh: requests of random lengths
    arriving at random steps, more than both shards hold at once, greedy and seeded sampling;
    every output equals the unsharded engine serving that request alone."""
    ref, eng = engines
    rng = np.random.default_rng(3)
    n = 24
    lens, news = rng.integers(1, 20, n), rng.integers(1, 5, n)
    prompts = [rng.integers(0, 64, int(k)).tolist() for k in lens]
    kinds = [dict(), dict(temperature=0.8, seed=11), dict(temperature=1.0, top_k=5, seed=12),
             dict(temperature=0.7, top_p=0.9, seed=13)]
    order = rng.permutation(n)
    rid_of, outs, arrived, waited, shards = {}, {}, 0, False, set()
    while arrived < n or eng.has_unfinished():
        for _ in range(rng.integers(0, 4) if arrived < n else 0):  # random arrivals
            if arrived < n:
                i = int(order[arrived])
                rid_of[eng.add_request(prompts[i], int(news[i]), **kinds[i % 4])] = i
                arrived += 1
        waited |= eng.num_waiting > 0
        shards |= {r.shard for r in eng.scheduler.running}
        for rid, tok, _ in eng.step():
            outs.setdefault(rid_of[rid], []).append(tok)
    assert waited and shards == {0, 1}
    for i in range(n):
        assert outs[i] == ref.generate([prompts[i]], int(news[i]), **kinds[i % 4])[0], i
    assert eng.num_free_slots == eng.capacity
    assert_whole(eng)


def test_engine_on_a_mesh_streams_aborts_and_generates(engines):
    ref, eng = engines
    prompts, news = _workload()
    prompts = prompts[:6]
    want = ref.generate(prompts, 5)
    got = [[] for _ in prompts]
    stream = eng.stream(prompts, 5)
    rids = stream.request_ids
    for i, tok in stream:
        got[i].append(tok)
        if i == 0 and len(got[0]) == 2:
            assert eng.abort(rids[3])  # running or waiting: either is safe
    assert got[3] == want[3][: len(got[3])] and len(got[3]) < 5
    assert [g for i, g in enumerate(got) if i != 3] == [w for i, w in enumerate(want) if i != 3]
    assert eng.generate(prompts[:3], 4) == [w[:4] for w in want[:3]]
    assert not eng.has_unfinished() and eng.num_free_slots == eng.capacity
    assert_whole(eng)


def test_engine_mesh_errors_name_the_value(params):
    from hybridattn.engine import Engine

    mesh = MS.make_mesh(2, 4)
    geo = dict(ENGINE, num_token_slots=98)
    with pytest.raises(ValueError, match=r"num_snapshot_slots=9 is not divisible by the "
                                         r"mesh's data size 2"):
        Engine(CFG, params, mesh=mesh, num_snapshot_slots=9, **geo)
    with pytest.raises(ValueError, match=r"max_running_requests=3 is not divisible by the "
                                         r"mesh's data size 2"):
        Engine(CFG, params, mesh=mesh, **{**geo, "max_running_requests": 3})
    with pytest.raises(ValueError, match=r"num_token_slots=97 is not divisible by the mesh's "
                                         r"data size 2"):
        Engine(CFG, params, mesh=mesh, **{**geo, "num_token_slots": 97})
    cfg4 = dataclasses.replace(CFG, num_experts=4)
    with pytest.raises(ValueError, match=r"num_experts=4 is not divisible by the mesh's "
                                         r"data\*tensor size 8"):
        Engine(cfg4, kimi_linear.init_params(cfg4, jax.random.key(0)), mesh=mesh, **geo)
    with pytest.raises(ValueError, match=r"mesh=.* must be a jax.sharding.Mesh"):
        Engine(CFG, params, mesh=(2, 4), **geo)
    # a shard's pool (16 slots) smaller than the context: requests must fit one shard
    eng = Engine(CFG, params, mesh=mesh, **{**geo, "num_token_slots": 34,
                                            "max_running_requests": 2})
    assert (eng.shard_capacity, eng.max_running_requests) == (16, 2)
    with pytest.raises(ValueError, match=r"needs a context of 20 tokens, more than a data "
                                         r"shard's token pool holds.*per data shard \(of 2\)"):
        eng.add_request([1] * 20, 1)
    with pytest.raises(ValueError, match=r"prompt: logprobs=2 is not supported by an engine "
                                         r"on a mesh"):
        eng.add_request([1, 2], 1, logprobs=2)
    assert not eng.has_unfinished()


@pytest.mark.mlx
def test_engine_on_a_2x4_mesh_equals_mlx_lm(engines, params, tmp_path):
    """The independent oracle: mlx-lm's Kimi-Linear reading the same checkpoint, greedy, one
    request at a time with its own caches."""
    from harness import mlx_greedy, mlx_kimi

    kimi_linear.save_pretrained(params, CFG, tmp_path)
    model = mlx_kimi(tmp_path, CFG)
    _, eng = engines
    prompts, news = _workload()
    got = [[] for _ in prompts]
    for i, tok in eng.stream(prompts[:8], 4):  # 8 requests on 4 rows: some wait
        got[i].append(tok)
    assert got[:8] == [mlx_greedy(model, p, 4) for p in prompts[:8]]


def test_engine_with_grouped_layers_on_a_2x4_mesh_equals_the_unsharded_engine():
    """Layers stacked by ``group_plan`` (CFG's widths, 9 layers: layer 0, then groups of KDA
    layers each ending in an MLA layer; layer 0, dense, runs in the first group's loop with
    its MLP behind a ``lax.cond``) run as one scan in each device's step: the sharded engine's
    greedy tokens equal the unsharded engine's."""
    from hybridattn.engine import Engine

    cfg = KimiLinearConfig.tiny(num_hidden_layers=9, full_attention_layer_ids=(2, 5, 8),
                                hidden_size=32, vocab_size=64, linear_num_heads=8,
                                linear_head_dim=8, num_attention_heads=8, num_experts=8,
                                intermediate_size=64, moe_intermediate_size=16)
    assert kimi_linear.group_plan(cfg) == (1, (1, 2, 2), 0)
    params = kimi_linear.init_params(cfg, jax.random.key(1))
    ref = Engine(cfg, params, num_token_slots=97, request_buckets=(4,), prefix_cache=False,
                 **ENGINE)
    eng = Engine(cfg, params, num_token_slots=2 * 49, request_buckets=(2,),
                 mesh=MS.make_mesh(2, 4), **ENGINE)
    layers = eng.params["model"]["layers"]
    assert isinstance(layers, kimi_linear.GroupedLayers) and layers.folded == 1
    prompts, news = _workload()
    assert eng.generate(prompts[:6], 4) == ref.generate(prompts[:6], 4)
