"""Layers of one kind compiled once: ``kimi_linear.stack_layers`` and the ``lax.scan`` over a
repeated run of layers.

Oracles: mlx-lm's own Kimi-Linear (greedy, its own caches) on a 6-layer model that is three
repeats of (KDA, MLA), on an 11-layer one run as groups of KDA layers ending in an MLA layer
(``group_plan``) and on a 12-layer one whose dense layer 0 runs in the first group's loop
(``folded_layers``), served with the prefix cache on (snapshots taken and restored inside the
scan); the unrolled step on the same parameters, to float32 rounding, for the logits and
every pool. The default tiny config (every engine test) scans its layers 1 and 2 (KDA with
MoE).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import mlx_greedy as greedy_oracle
from harness import mlx_kimi, realistic_params

from hybridattn import serving as S
from hybridattn.backends import ForwardMode
from hybridattn.config import KimiLinearConfig
from hybridattn.engine import Engine
from hybridattn.models import kimi_linear as M
from hybridattn.pools import alloc_reqs_or_raise

# KDA and MLA alternating, dense MLPs: the whole model is 3 repeats of (KDA, MLA), so the scan
# body holds both kinds and the step compiles 2 layers (cheap enough for the suite)
CFG = KimiLinearConfig.tiny(num_hidden_layers=6, num_experts=0, hidden_size=32,
                            full_attention_layer_ids=(1, 3, 5))
PARAMS = realistic_params(CFG)
# Groups of KDA layers each ending in an MLA layer (group_plan): (K, K, M), (M), (K, K, M),
# (K, K, M), then one KDA layer: the step compiles the KDA body, the MLA body and the tail, 3
# of 11 (the period, (K, K, M) twice from layer 4, would compile 8)
GCFG = KimiLinearConfig.tiny(num_hidden_layers=11, num_experts=0, hidden_size=32,
                             full_attention_layer_ids=(2, 3, 6, 9))
GPARAMS = realistic_params(GCFG)
# The released head: layer 0 KDA with a dense MLP, the rest MoE; groups (K, K, M), (K, K, K, M),
# (K, K, K, M): layer 0 runs in the first group's loop (folded_layers), its MLP picked by a
# lax.cond, so the step compiles 2 layers of 12
FCFG = KimiLinearConfig.tiny(num_hidden_layers=12, hidden_size=32)
FPARAMS = realistic_params(FCFG)
CONFIGS = {"period": (CFG, PARAMS), "groups": (GCFG, GPARAMS), "folded": (FCFG, FPARAMS)}


def test_layer_plan_finds_the_longest_repeated_run():
    tiny = KimiLinearConfig.tiny
    assert M.layer_plan(tiny(num_hidden_layers=27)) == (1, 4, 6)  # the released pattern
    assert M.layer_plan(tiny(num_hidden_layers=12)) == (1, 4, 2)
    assert M.layer_plan(CFG) == (0, 2, 3)
    assert M.layer_plan(tiny()) == (1, 1, 2)  # layers 1 and 2: KDA with MoE
    assert M.layer_plan(tiny(num_hidden_layers=2)) == (0, 0, 0)
    # the same kinds with MoE after a dense layer 0: (MLA, KDA) from layer 1, three times
    assert M.layer_plan(tiny(num_hidden_layers=8, full_attention_layer_ids=(1, 3, 5, 7))) == (
        1, 2, 3)


def test_group_plan_and_the_plan_that_compiles_fewer_layers():
    tiny = KimiLinearConfig.tiny
    assert M.group_plan(tiny(num_hidden_layers=27)) == (1, (2, 3, 3, 3, 3, 3, 2), 0)
    assert M.group_plan(GCFG) == (0, (2, 0, 2, 2), 1)
    assert M.group_plan(FCFG) == (1, (2, 3, 3), 0)
    assert [M.folded_layers(c) for c in (tiny(num_hidden_layers=27), GCFG, FCFG, CFG)] == [
        1, 0, 1, 0]
    assert M.group_plan(CFG) == (0, (1, 1, 1), 0)  # 2 compiled either way: the period wins
    assert M.group_plan(tiny()) == (0, (), 0)  # one MLA layer: no two groups
    # 8 layers: the period (layers 4-6) leaves 5 layers unrolled, which run faster than in
    # a loop, so the groups (3 compiled, 7 looped) are not taken
    assert M.group_plan(tiny(num_hidden_layers=8)) == (1, (2, 3), 0)
    assert [M.compiled_layers(c) for c in (tiny(num_hidden_layers=27), GCFG, FCFG, CFG, tiny(),
                                           tiny(num_hidden_layers=8))] == [2, 3, 2, 2, 3, 6]
    assert isinstance(M.stack_layers(PARAMS, CFG)["model"]["layers"], M.StackedLayers)
    assert isinstance(M.stack_layers(GPARAMS, GCFG)["model"]["layers"], M.GroupedLayers)
    folded = M.stack_layers(FPARAMS, FCFG)["model"]["layers"]
    assert (folded.folded, folded.head, folded.fold["mlp"]["up_proj"]["weight"].shape[0],
            folded.kda["self_attn"]["o_proj"]["weight"].shape[0],
            folded.kda["block_sparse_moe"]["gate"]["weight"].shape[0]) == (1, [], 1, 9, 8)


@pytest.mark.parametrize("which", CONFIGS)
def test_stacking_keeps_the_checkpoint_layout_and_unstacks_exactly(tmp_path, which):
    cfg, params = CONFIGS[which]
    stacked = M.stack_layers(params, cfg)
    layers = stacked["model"]["layers"]
    assert isinstance(layers, M.STACKED) and len(jax.tree.leaves(stacked)) < len(
        jax.tree.leaves(params))
    assert M.stack_layers(stacked, cfg) is stacked
    M.check_params(stacked, cfg)
    back = M.unstack_layers(stacked)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back),
                                                    jax.tree.leaves(params), strict=True))
    # the serving layout and back, stacked
    back = M.checkpoint_layout(M.serving_layout(stacked))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back),
                                                    jax.tree.leaves(params), strict=True))
    # saved from the stacked copy: the same tensor names and values as from the original
    M.save_pretrained(stacked, cfg, tmp_path / "ckpt")
    config, loaded = M.load(tmp_path / "ckpt")
    assert config == cfg
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded),
                                                    jax.tree.leaves(params), strict=True))


def _close(a, b, what, tol=1e-5):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    err = float(np.max(np.abs(a - b))) if a.size else 0.0
    assert err <= tol * max(1.0, float(np.abs(b).max())), f"{what}: max |scan - unrolled| = {err}"


@pytest.mark.parametrize("which", CONFIGS)
def test_the_scanned_step_equals_the_unrolled_step(which):
    """A prefill of two requests, then three decodes: logits, tokens and every pool of every
    layer agree."""
    CFG, PARAMS = CONFIGS[which]
    state = S.ServingState.create(CFG, max_running_requests=4, max_context_len=64,
                                  num_token_slots=257)
    pool, rows = alloc_reqs_or_raise(state.req_to_token_pool, 2)
    state = state.replace(req_to_token_pool=pool)
    rng = np.random.default_rng(3)
    a, b = (rng.integers(0, CFG.vocab_size, n).tolist() for n in (13, 29))
    step = jax.jit(S.step)
    stacked = M.stack_layers(PARAMS, CFG)
    states = {"unrolled": state, "scanned": state}
    batch = S.make_worker_batch([S.WorkItem(rows[0], 0, a), S.WorkItem(rows[1], 0, b)],
                                vocab_size=CFG.vocab_size, max_context_len=64, num_requests=4,
                                num_tokens=48, kv_width=64, max_extend_len=48)
    lens = [len(a), len(b)]
    for n in range(4):
        outs = {}
        for name, params in (("unrolled", PARAMS), ("scanned", stacked)):
            states[name], outs[name] = step(params, states[name], batch)
        u, s = outs["unrolled"], outs["scanned"]
        assert bool(u.ok) and bool(s.ok)
        _close(s.logits, u.logits, f"step {n} logits")
        toks = [int(t) for t in u.next_token_ids[:2]]
        assert [int(t) for t in s.next_token_ids[:2]] == toks
        batch = S.make_worker_batch(
            [S.WorkItem(rows[i], lens[i], [toks[i]]) for i in range(2)],
            vocab_size=CFG.vocab_size, max_context_len=64, forward_mode=ForwardMode.DECODE,
            num_requests=4, kv_width=64)
        lens = [m + 1 for m in lens]
    u, s = states["unrolled"], states["scanned"]
    for name in ("c_kv", "k_pe"):
        _close(getattr(s.token_to_kv_pool, name), getattr(u.token_to_kv_pool, name), name)
    for name in ("conv", "ssm"):
        _close(getattr(s.recurrent_state_pool, name), getattr(u.recurrent_state_pool, name),
               name)


@pytest.fixture(scope="module", params=list(CONFIGS))
def served(request, tmp_path_factory):
    """``(config, params, layout, greedy)``: a config of ``CONFIGS``, the class its engine
    stacks its layers into, and mlx-lm's greedy decoding of the same checkpoint."""
    cfg, params = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(f"kimi-{request.param}") / "ckpt"
    M.save_pretrained(params, cfg, path)
    model = mlx_kimi(path, cfg)
    layout = M.StackedLayers if request.param == "period" else M.GroupedLayers
    return cfg, params, layout, lambda prompt, n: greedy_oracle(model, prompt, n)


def test_a_scanned_engine_with_the_prefix_cache_gives_mlx_lm_greedy_tokens(served):
    CFG, PARAMS, layout, mlx_greedy = served
    eng = Engine(CFG, PARAMS, max_running_requests=4, max_context_len=96,
                 num_token_slots=385, chunk_size=32, chunked_prefill_size=64,
                 request_buckets=(4,), token_buckets=(16, 80), kv_buckets=(96,),
                 snapshot_interval=32, num_snapshot_slots=17)
    assert isinstance(eng.params["model"]["layers"], layout)
    rng = np.random.default_rng(5)
    system = rng.integers(0, CFG.vocab_size, 40).tolist()
    prompts = [system + rng.integers(0, CFG.vocab_size, n).tolist() for n in (3, 9, 5)]
    first = eng.generate(prompts[:1], 5)  # cold: leaves a snapshot at 32 and at its end
    rest = eng.generate(prompts[1:], 5)  # both start from the restored snapshot
    assert eng.stats.cached_tokens >= 64
    assert first + rest == [mlx_greedy(p, 5) for p in prompts]


@pytest.mark.parametrize("which", CONFIGS)
def test_apply_takes_stacked_parameters(which):
    CFG, PARAMS = CONFIGS[which]
    ids = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (1, 9)))
    fwd = jax.jit(M.apply, static_argnums=1)
    np.testing.assert_array_equal(np.asarray(fwd(M.stack_layers(PARAMS, CFG), CFG, ids)),
                                  np.asarray(fwd(PARAMS, CFG, ids)))
