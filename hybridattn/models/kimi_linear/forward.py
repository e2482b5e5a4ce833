"""The serving forward: every layer through the attention backend, the pools in the batch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from hybridattn.config import KimiLinearConfig
from hybridattn.models.kimi_linear.layers import _attend, _mlp, decoder_layer
from hybridattn.models.kimi_linear.params import check_supported
from hybridattn.models.kimi_linear.primitives import Params, rms_norm
from hybridattn.models.kimi_linear.stacking import GroupedLayers, StackedLayers, _mlp_apart
from hybridattn.pools import LayerRef

__all__ = [
    "compute_logits",
    "forward",
]

def forward(
    params: Params, config: KimiLinearConfig, backend, batch, comm=None
) -> tuple[Float[Array, "T D"], Any]:
    """Serving forward over ``batch.input_ids [T]``: ``(hidden [T, D], batch)`` with the
    batch's pools updated by every layer. ``backend`` must carry this batch's metadata;
    ``comm`` (None: one device) is how ``hybridattn.sharding`` joins the shards of a mesh.
    ``hybridattn.step`` runs it for you; by hand, one 3-token prompt in row 1 (token slots
    1-3), shapes only (``jax.eval_shape`` compiles nothing):

    >>> from hybridattn.models.kimi_linear import param_shapes
    >>> from hybridattn import BatchRequest, ServingState, make_forward_batch
    >>> from hybridattn.pools import alloc_reqs_or_raise, write_token_slots
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> state = ServingState.create(cfg, max_running_requests=1, max_context_len=8,
    ...                             num_token_slots=9)
    >>> req, rows = alloc_reqs_or_raise(state.req_to_token_pool, 1)
    >>> req = write_token_slots(req, jnp.array([1, 1, 1]), jnp.arange(3), jnp.array([1, 2, 3]))
    >>> batch = make_forward_batch(
    ...     [BatchRequest(req_index=1, prefix_len=0, token_ids=[5, 6, 7], slots=[1, 2, 3])],
    ...     req_to_token_pool=req, token_to_kv_pool=state.token_to_kv_pool,
    ...     recurrent_state_pool=state.recurrent_state_pool)
    >>> backend = state.backend.with_forward_metadata(state.backend.get_forward_metadata(batch))
    >>> hidden, batch = jax.eval_shape(lambda p, b: forward(p, cfg, backend, b),
    ...                                param_shapes(cfg), batch)
    >>> hidden.shape, batch.token_to_kv_pool.c_kv.shape  # [T, D]; the updated MLA pool
    ((3, 32), (1, 9, 32))
    """
    check_supported(config)
    x = params["model"]["embed_tokens"]["weight"][batch.input_ids]
    layers = params["model"]["layers"]
    if isinstance(layers, StackedLayers):
        x, batch = _stacked_forward(layers, config, x, backend, batch, comm)
    elif isinstance(layers, GroupedLayers):
        x, batch = _grouped_forward(layers, config, x, backend, batch, comm)
    else:
        for i, layer in enumerate(layers):
            x, batch = decoder_layer(layer, config, i, x, backend, batch, comm)
    return rms_norm(x, params["model"]["norm"]["weight"], config.rms_norm_eps), batch


def _stacked_forward(layers: StackedLayers, config: KimiLinearConfig, x, backend, batch, comm):
    """``forward``'s layers over stacked parameters: the head and tail layer by layer, the
    repeated run as one ``lax.scan`` whose body is one period. A layer at position ``j`` of
    repeat ``k`` reaches its pools through ``LayerRef(start + j, first[j] + k * per[j])``:
    its kind's pool index is the first repeat's plus ``k`` times that kind's count per
    period."""
    start, period, reps = layers.plan
    for i, p in enumerate(layers.head):
        x, batch = decoder_layer(p, config, i, x, backend, batch, comm)
    ids = range(start, start + period)
    kinds = [config.kda_layer_ids if config.is_kda_layer(i) else config.full_attention_layer_ids
             for i in ids]
    first = [kind.index(i) for kind, i in zip(kinds, ids, strict=True)]
    per = [sum(j in kind for j in ids) for kind in kinds]

    def one_period(carry, xs):
        x, batch = carry
        k, ps = xs
        for j, i in enumerate(ids):
            layer = LayerRef(i, first[j] + k * per[j])
            x, batch = decoder_layer(ps[j], config, layer, x, backend, batch, comm)
        return (x, batch), None

    (x, batch), _ = jax.lax.scan(one_period, (x, batch),
                                 (jnp.arange(reps, dtype=jnp.int32), list(layers.body)))
    for k, p in enumerate(layers.tail):
        x, batch = decoder_layer(p, config, start + period * reps + k, x, backend, batch, comm)
    return x, batch


def _grouped_forward(layers: GroupedLayers, config: KimiLinearConfig, x, backend, batch,
                     comm):
    """``forward``'s layers over ``GroupedLayers``: the head and tail layer by layer, the
    groups as one ``lax.scan`` whose body runs its group's KDA layers in a loop (their count
    a scanned value; the first group's loop runs the ``folded`` layers before it too) and
    then its MLA layer. The ``j``-th KDA layer of the loop reaches its pools through
    ``LayerRef(first KDA id, its KDA index)``, MLA layer ``g`` likewise. A folded layer's MLP
    is not the groups' kind: the loop picks it with a ``lax.cond`` on ``j``, each branch
    taking its own weights (only the branch that runs reads them)."""
    start, groups, F = layers.start, layers.groups, layers.folded
    for i, p in enumerate(layers.head):
        x, batch = decoder_layer(p, config, F + i, x, backend, batch, comm)
    end = start + sum(groups) + len(groups)
    kda_ids = [*range(F), *(i for i in range(start, end) if config.is_kda_layer(i))]
    mla_ids = [i for i in range(start, end) if not config.is_kda_layer(i)]
    kda0 = config.kda_layer_ids.index(kda_ids[0])
    mla0 = config.full_attention_layer_ids.index(mla_ids[0])
    rest, mlps = _mlp_apart(layers.kda)
    index = lambda tree, j: jax.tree.map(  # noqa: E731
        lambda a: jax.lax.dynamic_index_in_dim(a, j, keepdims=False), tree)

    def kda_layer(j, carry):
        x, h, batch = _attend(index(rest, j), config, LayerRef(kda_ids[0], kda0 + j),
                              carry[0], backend, carry[1], comm)

        def mlp(tree, k, layer):
            return lambda h: _mlp(index(tree, k), config, layer, h, comm)

        if F:
            m = jax.lax.cond(j < F, mlp(layers.fold, j, 0), mlp(mlps, j - F, kda_ids[F]), h)
        else:
            m = mlp(mlps, j, kda_ids[0])(h)
        return x + m, batch

    def group(carry, xs):
        first, count, g, p = xs
        x, batch = jax.lax.fori_loop(first, first + count, kda_layer, carry)
        x, batch = decoder_layer(p, config, LayerRef(mla_ids[0], mla0 + g), x, backend, batch,
                                 comm)
        return (x, batch), None

    counts = np.asarray(groups, np.int32)
    counts[0] += F
    firsts = np.cumsum(counts, dtype=np.int32) - counts
    (x, batch), _ = jax.lax.scan(
        group, (x, batch), (jnp.asarray(firsts), jnp.asarray(counts),
                            jnp.arange(len(groups), dtype=jnp.int32), layers.mla))
    for k, p in enumerate(layers.tail):
        x, batch = decoder_layer(p, config, end + k, x, backend, batch, comm)
    return x, batch


def compute_logits(
    params: Params, config: KimiLinearConfig, hidden: Float[Array, "N D"]
) -> Float[Array, "N V"]:
    """Logits (float32) of final hidden states ``[N, D]``: ``lm_head``, or the embedding
    when ``tie_word_embeddings``.

    >>> from hybridattn.models.kimi_linear import init_params
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> params = init_params(cfg, jax.random.key(0))
    >>> compute_logits(params, cfg, jnp.ones((3, 32), jnp.bfloat16)).dtype
    dtype('float32')
    >>> compute_logits(params, cfg, jnp.ones((3, 32))).shape  # [N, V]
    (3, 64)
    """
    head = (params["model"]["embed_tokens"] if config.tie_word_embeddings
            else params["lm_head"])["weight"]
    return hidden.astype(jnp.float32) @ head.T.astype(jnp.float32)
