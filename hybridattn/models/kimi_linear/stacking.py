"""Layers stacked for ``lax.scan``: which layers share a shape (:func:`group_plan`), the
stacked parameter trees and back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from hybridattn.config import KimiLinearConfig
from hybridattn.models.kimi_linear.primitives import Params
from hybridattn.pytree import pytree_dataclass

__all__ = [
    "STACKED",
    "GroupedLayers",
    "StackedLayers",
    "compiled_layers",
    "folded_layers",
    "group_plan",
    "layer_plan",
    "stack_layer_list",
    "stack_layers",
    "unstack_layers",
]

# --------------------------------------------------------------------------------------------
# layers of one kind compiled once: a scan over stacked layers
# --------------------------------------------------------------------------------------------


def layer_plan(config: KimiLinearConfig) -> tuple[int, int, int]:
    """``(start, period, repeats)``: layers ``start .. start + period * repeats - 1`` repeat
    one pattern of ``period`` layers (kind and MLP: KDA or MLA, dense or MoE) ``repeats``
    times, the longest such run (then the earliest, then the shortest period); ``(0, 0, 0)``
    when nothing repeats. ``stack_layers`` stacks that run; the step compiles ``period``
    layers for it instead of ``period * repeats``.

    The released 27-layer pattern (MLA every 4th layer and the last; layer 0 dense): one
    layer, six repeats of (KDA, KDA, MLA, KDA), two more; 7 layers compiled instead of 27.

    >>> layer_plan(KimiLinearConfig.tiny(num_hidden_layers=27))
    (1, 4, 6)
    >>> layer_plan(KimiLinearConfig.tiny())  # 4 layers: 1 and 2 (KDA, MoE) repeat
    (1, 1, 2)
    >>> layer_plan(KimiLinearConfig.tiny(num_hidden_layers=2))  # nothing repeats
    (0, 0, 0)
    """
    n = config.num_hidden_layers
    sig = [(config.is_kda_layer(i), config.is_moe_layer(i)) for i in range(n)]
    best, saved = (0, 0, 0), 0
    for start in range(n):
        for period in range(1, (n - start) // 2 + 1):
            unit, reps = sig[start:start + period], 1
            while sig[start + reps * period:start + (reps + 1) * period] == unit:
                reps += 1
            if (reps - 1) * period > saved:
                best, saved = (start, period, reps), (reps - 1) * period
    return best


@pytree_dataclass(static=("plan",))
class StackedLayers:
    """``params["model"]["layers"]`` of ``stack_layers``: the layers before the repeated run
    (``head``, as they are), the run (``body``: ``period`` layer dicts whose leaves are
    stacked ``[repeats, ...]``, position ``j`` holding layers ``start + j + k * period``) and
    the layers after it (``tail``). ``plan`` is ``layer_plan(config)``.

    >>> from hybridattn.models.kimi_linear import init_params
    >>> cfg = KimiLinearConfig.tiny(hidden_size=32, vocab_size=64)  # layers 1 and 2 repeat
    >>> layers = stack_layers(init_params(cfg, jax.random.key(0)), cfg)["model"]["layers"]
    >>> layers.plan, len(layers.head), len(layers.body), len(layers.tail)
    ((1, 1, 2), 1, 1, 1)
    >>> layers.body[0]["input_layernorm"]["weight"].shape  # [repeats, D]
    (2, 32)
    """

    head: Any
    body: Any
    tail: Any
    plan: tuple[int, int, int]


def group_plan(config: KimiLinearConfig) -> tuple[int, tuple[int, ...], int]:
    """``(start, groups, tail)``: from layer ``start`` on, the layers are groups of
    ``groups[g]`` KDA layers followed by one MLA layer, every KDA layer there alike and every
    MLA layer alike (kind and MLP), then ``tail`` more layers; ``(0, (), 0)`` when there are
    not two such groups. ``stack_layers`` may run them (``_plans`` says when) as one
    ``lax.scan`` over the groups with a loop over each group's KDA layers, the ``start``
    layers before them in the first group's loop too when ``folded_layers`` says so: the step
    then compiles ``2 + tail`` layers (``start + 2 + tail`` when they are not folded).

    The released 27-layer pattern (MLA every 4th layer and the last; layer 0 dense): layer 0,
    then seven groups; 2 layers compiled instead of 27 (the period plan compiles 7).

    >>> group_plan(KimiLinearConfig.tiny(num_hidden_layers=27))
    (1, (2, 3, 3, 3, 3, 3, 2), 0)
    >>> group_plan(KimiLinearConfig.tiny(num_hidden_layers=10, full_attention_layer_ids=(3, 7)))
    (1, (2, 3), 2)
    >>> group_plan(KimiLinearConfig.tiny(num_hidden_layers=2))
    (0, (), 0)
    """
    n = config.num_hidden_layers
    sig = [(config.is_kda_layer(i), config.is_moe_layer(i)) for i in range(n)]
    start = 0
    while start < n and len(set(sig[start:])) > 2:
        start += 1
    mla = [i for i in range(start, n) if not sig[i][0]]
    if len(mla) < 2 or not any(sig[i][0] for i in range(start, mla[-1])):
        return 0, (), 0
    groups = tuple(b - a - 1 for a, b in zip([start - 1, *mla[:-1]], mla, strict=True))
    return start, groups, n - mla[-1] - 1


def folded_layers(config: KimiLinearConfig) -> int:
    """How many layers before ``group_plan``'s groups run inside the first group's loop of KDA
    layers: all of them (``start``) when they are KDA layers with one kind of MLP, else 0.
    Their MLP is not the groups' (else they would be in the groups), so the loop runs it by a
    ``lax.cond`` on the layer's index. The released pattern's dense layer 0 is so: the step
    compiles one KDA layer for all 20 and one MLA layer for all 7.

    >>> folded_layers(KimiLinearConfig.tiny(num_hidden_layers=27))
    1
    >>> folded_layers(KimiLinearConfig.tiny(num_hidden_layers=27, num_experts=0))  # no head
    0
    """
    start, groups, _ = group_plan(config)
    head = range(start)
    if not groups or not all(config.is_kda_layer(i) for i in head):
        return 0
    return start if len({config.is_moe_layer(i) for i in head}) == 1 else 0


def compiled_layers(config: KimiLinearConfig) -> int:
    """Layers the serving step compiles once ``stack_layers`` has stacked what repeats.

    >>> [compiled_layers(KimiLinearConfig.tiny(num_hidden_layers=n)) for n in (2, 4, 8, 27)]
    [2, 3, 6, 2]
    """
    return _plans(config)[1]


def _plans(config: KimiLinearConfig) -> tuple[str | None, int]:
    """``(plan, compiled)``: how ``stack_layers`` stacks ``config``'s layers (``"period"``,
    ``"groups"`` or None: not at all) and the layers the step then compiles.

    The groups when they compile fewer layers than the period and the period already runs
    at least half the layers in its scan. A layer in a loop reads its weights by a traced
    index, which XLA:CPU copies out of the stack before each product: with 27 layers, where
    the period scans 24, the groups' step decoded in 0.94x the period's time and prefilled
    in 0.93x (``bench.serve_config``'s widths, B = 8); with 8, where the period scans 3 and
    runs 5 layers unrolled, the groups' decode took 1.14x.
    """
    n = config.num_hidden_layers
    _, period, reps = layer_plan(config)
    start, groups, tail = group_plan(config)
    looped = period * reps if reps >= 2 else 0
    by_period = n - looped + period if looped else n
    by_groups = start - folded_layers(config) + 2 + tail
    if groups and by_groups < by_period and 2 * looped >= n:
        return "groups", by_groups
    return ("period", by_period) if looped else (None, n)


@pytree_dataclass(static=("start", "groups", "folded"))
class GroupedLayers:
    """``params["model"]["layers"]`` of ``stack_layers`` by ``group_plan``: the layers before
    the groups that do not run in their loop (``head``), the loop's KDA layers (``kda``: one
    layer dict whose leaves are stacked in layer order: ``[folded + sum(groups), ...]``, the
    MLP's ``[sum(groups), ...]``), the MLPs of the ``folded`` layers before the groups that
    run in the loop (``fold``: stacked ``[folded, ...]``, None when none;
    ``folded_layers``), the groups' MLA layers (``mla``: stacked ``[len(groups), ...]``) and
    the layers after them (``tail``).

    >>> from hybridattn.models.kimi_linear import init_params
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=12, hidden_size=32, vocab_size=64)
    >>> layers = stack_layers(init_params(cfg, jax.random.key(0)), cfg)["model"]["layers"]
    >>> layers.start, layers.groups, layers.folded, len(layers.head), len(layers.tail)
    (1, (2, 3, 3), 1, 0, 0)
    >>> layers.kda["input_layernorm"]["weight"].shape, layers.mla["input_layernorm"][
    ...     "weight"].shape  # layer 0 and the groups' 8 KDA layers; 3 MLA layers
    ((9, 32), (3, 32))
    >>> layers.kda["block_sparse_moe"]["gate"]["weight"].shape  # the groups' MoE: 8 layers
    (8, 4, 32)
    >>> layers.fold["mlp"]["gate_proj"]["weight"].shape  # layer 0's dense MLP
    (1, 128, 32)
    """

    head: Any
    kda: Any
    mla: Any
    tail: Any
    fold: Any
    start: int
    groups: tuple[int, ...]
    folded: int = 0


STACKED = (StackedLayers, GroupedLayers)
"""The layouts of ``params["model"]["layers"]`` that ``stack_layers`` makes."""


def stack_layer_list(layers: list, config: KimiLinearConfig,
                     stack: Callable[[list], Any]) -> Any:
    """``layers`` (one item per layer: a parameter dict, or anything laid out alike) as
    ``stack_layers`` lays them out, ``stack`` joining the items of layers run as one
    (``GroupedLayers`` or ``StackedLayers``); ``layers`` itself when nothing repeats.
    ``partitioning.stacked_param_specs`` lays out its specs with it.

    A folded layer's MLP (``folded_layers``) is stacked apart from its other entries, so with
    folded layers the items must be dicts keyed like a layer's parameters. Each layer's id as
    the leaf of its items:

    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=12)
    >>> items = [{"self_attn": i, ("block_sparse_moe" if i else "mlp"): i} for i in range(12)]
    >>> out = stack_layer_list(items, cfg, lambda xs: jax.tree.map(lambda *i: i, *xs))
    >>> out.head, out.kda["self_attn"], out.kda["block_sparse_moe"], out.fold
    ([], (0, 1, 2, 4, 5, 6, 8, 9, 10), (1, 2, 4, 5, 6, 8, 9, 10), {'mlp': (0,)})
    >>> out.mla["self_attn"], out.tail
    ((3, 7, 11), [])
    """
    n = len(layers)
    plan, _ = _plans(config)
    if plan == "groups":
        start, groups, tail = group_plan(config)
        folded = folded_layers(config)
        run = range(start, n - tail)
        kda = [layers[i] for i in run if config.is_kda_layer(i)]
        mla = [layers[i] for i in run if not config.is_kda_layer(i)]
        fold = None
        if folded:  # their MLPs apart; the rest of them first in the KDA stack
            head = [_mlp_apart(p) for p in layers[:folded]]
            parts = [_mlp_apart(p) for p in kda]
            kda = {**stack([p for p, _ in head] + [p for p, _ in parts]),
                   **stack([m for _, m in parts])}
            fold = stack([m for _, m in head])
        else:
            kda = stack(kda)
        return GroupedLayers(head=list(layers[folded:start]), kda=kda, mla=stack(mla),
                             tail=list(layers[n - tail:]), fold=fold, start=start,
                             groups=groups, folded=folded)
    start, period, reps = plan = layer_plan(config)
    if reps < 2:
        return layers
    end = start + period * reps
    body = [stack(layers[start + j:end:period]) for j in range(period)]
    return StackedLayers(head=list(layers[:start]), body=body, tail=list(layers[end:]),
                         plan=plan)


_MLP_KEYS = ("mlp", "block_sparse_moe")


def _mlp_apart(layer: dict) -> tuple[dict, dict]:
    """A layer dict as ``(everything but its MLP, its MLP)``."""
    return ({k: v for k, v in layer.items() if k not in _MLP_KEYS},
            {k: v for k, v in layer.items() if k in _MLP_KEYS})


def stack_layers(params: Params, config: KimiLinearConfig) -> Params:
    """``params`` with the layers that repeat stacked, so that ``forward`` runs them as one
    ``lax.scan`` and the step compiles each kind of layer there once: by ``layer_plan``'s
    repeated period (``StackedLayers``) or by ``group_plan``'s groups of KDA layers ending in
    an MLA layer (``GroupedLayers``) when they compile fewer layers and the period already
    loops over at least half of them (``compiled_layers``). Unchanged when nothing repeats or
    when already stacked.
    ``unstack_layers`` is the inverse; ``save_pretrained`` and ``to_checkpoint`` write the
    checkpoint layout either way.

    >>> from hybridattn.models.kimi_linear import init_params
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=12, hidden_size=32, vocab_size=64)
    >>> params = init_params(cfg, jax.random.key(0))
    >>> stacked = stack_layers(params, cfg)
    >>> layers = stacked["model"]["layers"]  # layer 0, then groups of 2, 3 and 3 KDA + 1 MLA
    >>> type(layers).__name__, layers.groups, layers.folded, len(layers.head), len(layers.tail)
    ('GroupedLayers', (2, 3, 3), 1, 0, 0)
    >>> layers.kda["self_attn"]["q_proj"]["weight"].shape  # layers 0, 1, 2, 4, 5, 6, 8, 9, 10
    (9, 64, 32)
    >>> back = unstack_layers(stacked)
    >>> jax.tree.all(jax.tree.map(jnp.array_equal, back, params))
    True
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=6, num_experts=0, hidden_size=32,
    ...                             vocab_size=64, full_attention_layer_ids=(1, 3, 5))
    >>> stack_layers(init_params(cfg, jax.random.key(0)), cfg)["model"]["layers"].plan
    (0, 2, 3)
    """
    layers = params["model"]["layers"]
    if isinstance(layers, STACKED):
        return params
    stacked = stack_layer_list(layers, config,
                               lambda items: jax.tree.map(lambda *xs: jnp.stack(xs), *items))
    if stacked is layers:
        return params
    return {**params, "model": {**params["model"], "layers": stacked}}


def unstack_layers(params: Params) -> Params:
    """The checkpoint layout (a list of layer dicts) of ``params``, stacked or not.

    >>> from hybridattn.models.kimi_linear import init_params
    >>> cfg = KimiLinearConfig.tiny(hidden_size=32, vocab_size=64)
    >>> params = init_params(cfg, jax.random.key(0))
    >>> layers = unstack_layers(stack_layers(params, cfg))["model"]["layers"]
    >>> len(layers), layers[2]["self_attn"]["q_proj"]["weight"].shape
    (4, (64, 32))
    >>> unstack_layers(params) is params  # not stacked: as it is
    True
    """
    layers = params["model"]["layers"]
    if isinstance(layers, GroupedLayers):
        F = layers.folded
        rest, mlps = _mlp_apart(layers.kda)

        def take(tree, i):
            return jax.tree.map(lambda x: x[i], tree)

        def kda(k):  # the k-th KDA layer of the loop
            return {**take(rest, k), **(take(layers.fold, k) if k < F else take(mlps, k - F))}

        run, k = [kda(k) for k in range(F)], F
        for g, count in enumerate(layers.groups):
            run += [kda(k + j) for j in range(count)]
            run.append(jax.tree.map(lambda x, g=g: x[g], layers.mla))
            k += count
        return {**params, "model": {**params["model"],
                                    "layers": [*run[:F], *layers.head, *run[F:],
                                               *layers.tail]}}
    if not isinstance(layers, StackedLayers):
        return params
    start, period, reps = layers.plan
    run = [jax.tree.map(lambda x, k=k: x[k], layers.body[j])
           for k in range(reps) for j in range(period)]
    return {**params, "model": {**params["model"],
                                "layers": [*layers.head, *run, *layers.tail]}}
