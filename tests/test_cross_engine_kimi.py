"""One Kimi-Linear checkpoint, two engines: ``hybridattn.Engine`` (JAX) and ``mlxcache.Engine``
(mlx-lm's model) give mlx-lm's greedy tokens, with prefix reuse on both.

The checkpoint is the harness's tiny model (3 KDA : 1 MLA, MoE with a shared expert after a
dense layer 0, ``exp(A_log)`` up to 200) written by ``save_pretrained`` in the release's
layout (``config.json`` + ``model.safetensors``). hybridattn reads it with
``kimi_linear.load``, mlx-lm with its own ``load_model`` (``mlx_lm.load`` would also want a
tokenizer, which the directory has none of). It is float32, as the params are: on CPU mlx's
``gather_mm`` (the MoE experts) runs only float32, and even a dense bf16 copy of the model
changes mlx-lm's own greedy tokens for 1 prompt in 20 (30 tokens, 6 generated), so exact
greedy tokens across two frameworks need float32 on both sides.

The hybridattn engine has the harness's geometry (``harness.ENGINE``).
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from harness import CFG, ENGINE, PARAMS, mlx_greedy  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402

import hybridattn  # noqa: E402
import mlxcache  # noqa: E402
from hybridattn.models import kimi_linear as M  # noqa: E402
from mlxcache.engine import ReuseDisabledWarning  # noqa: E402

pytestmark = pytest.mark.mlx

MAX = 6  # greedy tokens per request
# The harness's engine geometry, exactly: its compiled steps are in the on-disk compile cache
# once any other serving test of the run has built them (standalone and cold, this file pays
# three compilations, about two minutes on 2 cores).
GEOMETRY = ENGINE


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``(config, params, mlx_model)``: the checkpoint as each side loads it."""
    path = tmp_path_factory.mktemp("kimi_ckpt")
    M.save_pretrained(PARAMS, CFG, path)  # float32, as the params are
    config, params = M.load(path)
    model, mlx_config = load_model(path)
    assert mlx_config["model_type"] == "kimi_linear"
    return config, params, model


def _prompts(seed=0):
    """Three prompts sharing a 24-token prefix, then 4, 6 and 8 tokens of their own."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, CFG.vocab_size, 24).tolist()
    return [shared + rng.integers(0, CFG.vocab_size, n).tolist() for n in (4, 6, 8)]


def test_both_frameworks_read_the_checkpoint_as_the_same_float32_model(checkpoint):
    config, params, model = checkpoint
    assert config == CFG
    assert jax.tree.structure(params) == jax.tree.structure(PARAMS)
    assert all(a.dtype == b.dtype and np.array_equal(a, b)
               for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(PARAMS), strict=True))
    assert type(model).__module__ == "mlx_lm.models.kimi_linear"
    assert {str(v.dtype) for _, v in tree_flatten(model.parameters())} == {"mlx.core.float32"}


def test_both_engines_give_mlx_lm_greedy_tokens_with_reuse(checkpoint):
    """Siblings of a shared prefix, the same prompts again (full hits), then a follow-up turn
    (a prompt, its answer and a new message): every request gets mlx-lm's greedy tokens
    from both engines, and both serve the second round and the follow-up from their cache."""
    config, params, model = checkpoint
    jax_engine = hybridattn.Engine(config, params, **GEOMETRY)
    assert jax_engine.prefix_cache
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReuseDisabledWarning)  # kimi_linear keeps reuse
        mlx_engine = mlxcache.Engine(model, num_slots=512, num_snapshots=32,
                                     snapshot_interval=8)
    assert mlx_engine.reuse and mlx_engine.batched and mlx_engine.has_states

    def serve(prompts):
        """Both engines' tokens for ``prompts`` and the prompt tokens each served from its
        cache, after checking the tokens against mlx-lm's."""
        before = jax_engine.stats.cached_tokens, mlx_engine.stats.cached_tokens
        want = [mlx_greedy(model, p, MAX) for p in prompts]
        assert jax_engine.generate(prompts, MAX) == want
        assert mlx_engine.generate(prompts, max_tokens=MAX) == want
        return want, (jax_engine.stats.cached_tokens - before[0],
                      mlx_engine.stats.cached_tokens - before[1])

    prompts = _prompts()
    answers, _ = serve(prompts)
    # a full hit computes only the last prompt token again (its logits are needed)
    full_hit = sum(len(p) - 1 for p in prompts)
    assert serve(prompts)[1] == (full_hit, full_hit)
    follow_up = prompts[0] + answers[0] + _prompts(seed=1)[0][-5:]
    _, (jax_cached, mlx_cached) = serve([follow_up])
    # the prompt and the answer, but for the answer's last token in hybridattn (no step ran
    # it; mlxcache runs it at finish)
    least = len(prompts[0]) + MAX - 1
    assert jax_cached >= least and mlx_cached >= least, (jax_cached, mlx_cached)
    assert jax_engine.stats.snapshots_taken > 0 and mlx_engine.stats.snapshots_taken > 0

