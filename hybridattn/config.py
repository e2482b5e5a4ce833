"""``KimiLinearConfig``: the static description of a Kimi-Linear hybrid model.

A Kimi-Linear model stacks decoder layers of two kinds: KDA (Kimi Delta Attention, linear
attention with a recurrent state) and MLA (multi-head latent attention, a full-attention layer
with a compressed KV cache). Every layer's MLP is dense or a mixture of experts (MoE).

The config is a frozen, hashable dataclass of plain Python scalars and tuples, *not* a pytree:
it belongs in treedefs and ``jax.jit`` static arguments. Field names follow the released
checkpoint's ``config.json`` (and mlx-lm's ``ModelArgs``); layer indices are **0-indexed**
here, while the checkpoint's ``linear_attn_config`` lists them **1-indexed**.

Two on-disk formats are read by :meth:`KimiLinearConfig.from_dict`:

- the released checkpoint format (``moonshotai/Kimi-Linear-48B-A3B-Instruct``):
  ``linear_attn_config = {kda_layers, full_attn_layers (1-indexed), num_heads, head_dim,
  short_conv_kernel_size}``;
- the transformers format: ``layer_types`` (``"linear_attention"`` / ``"full_attention"`` per
  layer), ``mlp_layer_types`` (``"dense"`` / ``"sparse"``), ``linear_num_heads``,
  ``linear_head_dim``, ``linear_conv_kernel_dim`` and the aliases of transformers'
  ``attribute_map`` (``num_local_experts``, ``num_experts_per_tok``, ...).

Where a file carries both forms of a value they must agree. :meth:`KimiLinearConfig.to_dict`
writes the checkpoint format plus ``layer_types`` / ``mlp_layer_types``, so mlx-lm and
transformers both read the same layer kinds from it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["KimiLinearConfig"]

_KDA, _MLA = "linear_attention", "full_attention"
_DENSE, _SPARSE = "dense", "sparse"

# transformers' ``KimiLinearConfig.attribute_map``: alias -> field name.
_ALIASES = {
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
    "max_position_embeddings": "model_max_length",
}
# KDA sizes: field name -> (transformers' top-level key, key inside ``linear_attn_config``).
_KDA_SIZES = {
    "linear_num_heads": ("linear_num_heads", "num_heads"),
    "linear_head_dim": ("linear_head_dim", "head_dim"),
    "linear_conv_kernel_dim": ("linear_conv_kernel_dim", "short_conv_kernel_size"),
}
_FLOAT_FIELDS = ("rope_theta", "rms_norm_eps", "routed_scaling_factor")
_ROUTER_ACTIVATIONS = ("sigmoid", "softmax")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KimiLinearConfig:
    """Hyper-parameters of a Kimi-Linear model (KDA + MLA layers, MoE MLPs).

    Build one with :meth:`tiny` (tests, demos), :meth:`from_dict` / :meth:`from_pretrained`
    (a ``config.json``), or the keyword constructor. Layer indices are 0-indexed.

    >>> cfg = KimiLinearConfig.tiny()
    >>> cfg.kda_layer_ids, cfg.full_attention_layer_ids
    ((0, 1, 2), (3,))
    >>> [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)]
    [False, True, True, True]
    >>> cfg.to_dict()["linear_attn_config"]["full_attn_layers"]  # 1-indexed on disk
    [4]
    >>> KimiLinearConfig.from_dict(cfg.to_dict()) == cfg
    True
    """

    model_type: str = "kimi_linear"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: num_attention_heads
    # MLA
    kv_lora_rank: int
    q_lora_rank: int | None = None  # None: q is a plain projection
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_nope: bool = True  # True: MLA layers apply no rotary embedding
    rope_theta: float = 10000.0
    # KDA
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int = 4
    # layer kinds, 0-indexed; together they cover every layer exactly once
    full_attention_layer_ids: tuple[int, ...]
    kda_layer_ids: tuple[int, ...]
    # MoE; num_experts == 0 means a dense MLP everywhere
    num_experts: int = 0
    num_experts_per_token: int = 1
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    # the rest
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    model_max_length: int = 1048576
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.model_type != "kimi_linear":
            raise ValueError(f"model_type: expected 'kimi_linear', got {self.model_type!r}")
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "linear_num_heads",
                     "linear_head_dim", "model_max_length"):
            _require(name, getattr(self, name), getattr(self, name) > 0, "must be positive")
        if self.q_lora_rank is not None:
            _require("q_lora_rank", self.q_lora_rank, self.q_lora_rank > 0,
                     "must be positive or None")
        _require("linear_conv_kernel_dim", self.linear_conv_kernel_dim,
                 self.linear_conv_kernel_dim >= 2, "must be at least 2")
        for name in ("rope_theta", "rms_norm_eps"):
            _require(name, getattr(self, name), getattr(self, name) > 0, "must be positive")
        self._check_moe()
        kda, mla = _check_layer_lists(
            {"kda_layer_ids": self.kda_layer_ids,
             "full_attention_layer_ids": self.full_attention_layer_ids},
            self.num_hidden_layers, base=0)
        object.__setattr__(self, "kda_layer_ids", kda)
        object.__setattr__(self, "full_attention_layer_ids", mla)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    def _check_moe(self) -> None:
        _require("num_experts", self.num_experts, self.num_experts >= 0, "must be >= 0")
        _require("first_k_dense_replace", self.first_k_dense_replace,
                 self.first_k_dense_replace >= 0, "must be >= 0")
        _require("moe_layer_freq", self.moe_layer_freq, self.moe_layer_freq >= 1,
                 "must be >= 1")
        if self.num_experts == 0:
            return
        _require("num_experts_per_token", self.num_experts_per_token,
                 1 <= self.num_experts_per_token <= self.num_experts,
                 f"must be in 1..num_experts={self.num_experts}")
        _require("moe_intermediate_size", self.moe_intermediate_size,
                 self.moe_intermediate_size > 0, "must be positive when num_experts > 0")
        _require("num_shared_experts", self.num_shared_experts, self.num_shared_experts >= 0,
                 "must be >= 0")
        _require("moe_router_activation_func", self.moe_router_activation_func,
                 self.moe_router_activation_func in _ROUTER_ACTIVATIONS,
                 f"must be one of {_ROUTER_ACTIVATIONS}")
        _require("num_expert_group", self.num_expert_group,
                 self.num_expert_group >= 1 and self.num_experts % self.num_expert_group == 0,
                 f"must be >= 1 and divide num_experts={self.num_experts}")
        _require("topk_group", self.topk_group, 1 <= self.topk_group <= self.num_expert_group,
                 f"must be in 1..num_expert_group={self.num_expert_group}")

    # ---------------------------------------------------------------------------------------
    # layer kinds
    # ---------------------------------------------------------------------------------------

    @property
    def num_kda_layers(self) -> int:
        """Number of KDA (linear-attention) layers."""
        return len(self.kda_layer_ids)

    @property
    def num_mla_layers(self) -> int:
        """Number of MLA (full-attention) layers."""
        return len(self.full_attention_layer_ids)

    @property
    def q_head_dim(self) -> int:
        """Per-head query / key width of an MLA layer: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def layer_types(self) -> tuple[str, ...]:
        """transformers' ``layer_types``: ``"linear_attention"`` (KDA) or ``"full_attention"``."""
        kda = set(self.kda_layer_ids)
        return tuple(_KDA if i in kda else _MLA for i in range(self.num_hidden_layers))

    @property
    def mlp_layer_types(self) -> tuple[str, ...]:
        """transformers' ``mlp_layer_types``: ``"sparse"`` (MoE) or ``"dense"`` per layer."""
        return _mlp_layer_types(self.num_hidden_layers, self.num_experts,
                                self.first_k_dense_replace, self.moe_layer_freq)

    def is_kda_layer(self, i: int) -> bool:
        """Whether model layer ``i`` (0-indexed) is a KDA layer; otherwise it is MLA."""
        self._check_layer(i)
        return i in self.kda_layer_ids

    def is_moe_layer(self, i: int) -> bool:
        """Whether model layer ``i`` has an MoE MLP (mlx-lm's ``KimiDecoderLayer`` rule)."""
        self._check_layer(i)
        return _is_moe(i, self.num_experts, self.first_k_dense_replace, self.moe_layer_freq)

    def kda_layer_index(self, i: int) -> int:
        """Position of model layer ``i`` among the KDA layers (its recurrent-state slot)."""
        self._check_layer(i)
        if i not in self.kda_layer_ids:
            raise ValueError(f"layer {i} is an MLA layer, not a KDA layer")
        return self.kda_layer_ids.index(i)

    def mla_layer_index(self, i: int) -> int:
        """Position of model layer ``i`` among the MLA layers (its KV-cache slot)."""
        self._check_layer(i)
        if i not in self.full_attention_layer_ids:
            raise ValueError(f"layer {i} is a KDA layer, not an MLA layer")
        return self.full_attention_layer_ids.index(i)

    def _check_layer(self, i: int) -> None:
        n = self.num_hidden_layers
        if not 0 <= i < n:
            raise ValueError(f"layer {i} is out of range for num_hidden_layers={n} "
                             f"(0-indexed: 0..{n - 1})")

    # ---------------------------------------------------------------------------------------
    # construction and serialisation
    # ---------------------------------------------------------------------------------------

    @classmethod
    def tiny(cls, **overrides: Any) -> KimiLinearConfig:
        """A small config for tests and demos, with the released 3 KDA : 1 MLA pattern.

        4 layers by default (0, 1, 2 KDA; 3 MLA); layer 0 is dense, the rest MoE (4 experts,
        top-2, one shared). Overriding ``num_hidden_layers`` re-derives the pattern (every 4th
        layer, 1-indexed, and the last are MLA, as in the 27-layer release) unless layer ids
        are given; given only one of the two id tuples, the other is its complement.

        >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=6, num_experts=0)
        >>> cfg.full_attention_layer_ids, cfg.num_kda_layers, cfg.mlp_layer_types
        ((3, 5), 4, ('dense', 'dense', 'dense', 'dense', 'dense', 'dense'))
        """
        n = overrides.get("num_hidden_layers", 4)
        kda = overrides.get("kda_layer_ids")
        mla = overrides.get("full_attention_layer_ids")
        if kda is None and mla is None:
            mla = tuple(i for i in range(n) if (i + 1) % 4 == 0 or i == n - 1)
        if kda is None:
            kda = tuple(sorted(set(range(n)) - set(mla)))
        if mla is None:
            mla = tuple(sorted(set(range(n)) - set(kda)))
        defaults = dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=n,
            num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
            num_experts=4, num_experts_per_token=2, num_shared_experts=1,
            moe_intermediate_size=32, routed_scaling_factor=2.446, first_k_dense_replace=1,
            rms_norm_eps=1e-5, model_max_length=4096,
        )
        return cls(**{**defaults, **overrides, "kda_layer_ids": tuple(kda),
                      "full_attention_layer_ids": tuple(mla)})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KimiLinearConfig:
        """Read a ``config.json`` mapping in the checkpoint or the transformers format.

        A ``null`` value counts as absent (every field that may be ``None`` defaults to it).
        Keys this config does not describe (``architectures``, ``auto_map``, ``torch_dtype``,
        ``quantization_config``, ...) are ignored.
        """
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in _KDA_SIZES or f.name.endswith("layer_ids"):
                continue
            keys = [f.name, *(a for a, name in _ALIASES.items() if name == f.name)]
            value = _agreed(f.name, {k: d[k] for k in keys if d.get(k) is not None})
            if value is not _ABSENT:
                kw[f.name] = value
        if "rope_theta" not in kw and isinstance(d.get("rope_parameters"), Mapping):
            # transformers >= 5 moves rope_theta into rope_parameters
            theta = d["rope_parameters"].get("rope_theta")
            if theta is not None:
                kw["rope_theta"] = theta
        for name in _FLOAT_FIELDS:
            if isinstance(kw.get(name), int) and not isinstance(kw[name], bool):
                kw[name] = float(kw[name])
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = tuple(kw["eos_token_id"])

        lac = d.get("linear_attn_config") or {}
        for name, (top_key, lac_key) in _KDA_SIZES.items():
            sources = {k: v for k, v in ((top_key, d.get(top_key)),
                                         (f"linear_attn_config.{lac_key}", lac.get(lac_key)))
                       if v is not None}
            value = _agreed(name, sources)
            if value is not _ABSENT:
                kw[name] = value

        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in kw
                   and not f.name.endswith("layer_ids")]
        if missing:
            raise ValueError(f"config is missing required keys {missing}")
        n = kw["num_hidden_layers"]
        kw["kda_layer_ids"], kw["full_attention_layer_ids"] = _layer_kinds(d, lac, n)
        if d.get("mlp_layer_types") is not None:
            kw["first_k_dense_replace"] = _first_k_dense(
                d["mlp_layer_types"], n, kw.get("num_experts", 0),
                kw.get("first_k_dense_replace"), kw.get("moe_layer_freq", 1))
        return cls(**kw)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> KimiLinearConfig:
        """Read ``path/config.json`` (a checkpoint directory)."""
        with open(os.path.join(path, "config.json")) as fh:
            return cls.from_dict(json.load(fh))

    def to_dict(self) -> dict[str, Any]:
        """The released checkpoint's ``config.json`` format, plus ``layer_types`` and
        ``mlp_layer_types`` for transformers. JSON-serialisable; ``from_dict`` inverts it.
        """
        d: dict[str, Any] = {"architectures": ["KimiLinearForCausalLM"]}
        for f in dataclasses.fields(self):
            if f.name in _KDA_SIZES or f.name.endswith("layer_ids"):
                continue
            value = getattr(self, f.name)
            d[f.name] = list(value) if isinstance(value, tuple) else value
        d["linear_attn_config"] = {
            "kda_layers": [i + 1 for i in self.kda_layer_ids],
            "full_attn_layers": [i + 1 for i in self.full_attention_layer_ids],
            "num_heads": self.linear_num_heads,
            "head_dim": self.linear_head_dim,
            "short_conv_kernel_size": self.linear_conv_kernel_dim,
        }
        d["layer_types"] = list(self.layer_types)
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        # Legacy key of the released file (2304 // 32 = 72); mlx-lm's ModelArgs requires it
        # but, like transformers, takes every attention width from the fields above.
        d["head_dim"] = self.hidden_size // self.num_attention_heads
        return d

    def save_pretrained(self, path: str | os.PathLike[str]) -> None:
        """Write ``path/config.json`` (creating ``path``), readable by :meth:`from_pretrained`,
        mlx-lm and transformers."""
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as fh:
            json.dump(self.to_dict(), fh, indent=2, sort_keys=True)
            fh.write("\n")


# -------------------------------------------------------------------------------------------
# helpers
# -------------------------------------------------------------------------------------------

_ABSENT = object()


def _require(name: str, value: Any, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {what}, got {value!r}")


def _agreed(name: str, sources: Mapping[str, Any]) -> Any:
    """The one value all present ``sources`` (key -> value) give for field ``name``."""
    items = list(sources.items())
    for key, value in items[1:]:
        if value != items[0][1]:
            raise ValueError(f"{name}: {items[0][0]}={items[0][1]!r} disagrees with "
                             f"{key}={value!r}")
    return items[0][1] if items else _ABSENT


def _check_layer_lists(lists: Mapping[str, Iterable[int]], n: int,
                       base: int) -> tuple[tuple[int, ...], ...]:
    """Check that the named layer lists (``base``-indexed) partition ``n`` layers; return each
    as a sorted 0-indexed tuple."""
    lo, hi = base, n - 1 + base
    seen: dict[int, str] = {}
    out = []
    for name, layers in lists.items():
        layers = list(layers)
        for i in layers:
            if not isinstance(i, int) or isinstance(i, bool):
                raise ValueError(f"{name}: layer {i!r} is not an int")
            if not lo <= i <= hi:
                raise ValueError(f"{name}: layer {i} is out of range for num_hidden_layers={n} "
                                 f"({base}-indexed: {lo}..{hi})")
            if i in seen:
                where = "twice" if seen[i] == name else f"in both {seen[i]} and {name}"
                raise ValueError(f"{name}: layer {i} is listed {where}")
            seen[i] = name
        out.append(tuple(sorted(i - base for i in layers)))
    missing = [i for i in range(lo, hi + 1) if i not in seen]
    if missing:
        raise ValueError(f"{' / '.join(lists)}: layers {missing} ({base}-indexed) are in "
                         f"neither list")
    return tuple(out)


def _layer_kinds(d: Mapping[str, Any], lac: Mapping[str, Any],
                 n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(kda, mla) 0-indexed layer ids from ``linear_attn_config`` and / or ``layer_types``."""
    found = []
    lists = {k: lac.get(k) for k in ("kda_layers", "full_attn_layers")}
    absent = [k for k, v in lists.items() if v is None]
    if len(absent) == 1:
        # mlx-lm needs kda_layers and transformers ignores a lone list: refuse to guess.
        raise ValueError(f"linear_attn_config: has {(lists.keys() - absent).pop()} but not "
                         f"{absent[0]}; give both")
    if not absent:
        found.append(("linear_attn_config", _check_layer_lists(lists, n, base=1)))
    types = d.get("layer_types")
    if types is not None:
        if len(types) != n or not set(types) <= {_KDA, _MLA}:
            raise ValueError(f"layer_types: expected {n} entries of {_KDA!r} / {_MLA!r}, "
                             f"got {types!r}")
        found.append(("layer_types", (
            tuple(i for i, t in enumerate(types) if t == _KDA),
            tuple(i for i, t in enumerate(types) if t == _MLA))))
    if not found:
        raise ValueError("config has no layer kinds: expected linear_attn_config.kda_layers / "
                         "full_attn_layers or layer_types")
    return _agreed("layer kinds (kda, full attention; 0-indexed)", dict(found))


def _is_moe(i: int, num_experts: int, first_k_dense_replace: int, moe_layer_freq: int) -> bool:
    return num_experts > 0 and i >= first_k_dense_replace and i % moe_layer_freq == 0


def _mlp_layer_types(n: int, num_experts: int, first_k_dense_replace: int,
                     moe_layer_freq: int) -> tuple[str, ...]:
    return tuple(_SPARSE if _is_moe(i, num_experts, first_k_dense_replace, moe_layer_freq)
                 else _DENSE for i in range(n))


def _first_k_dense(types: list[str], n: int, num_experts: int, given: int | None,
                   freq: int) -> int:
    """The ``first_k_dense_replace`` that reproduces transformers' ``mlp_layer_types``."""
    types = tuple(types)
    candidates = [given] if given is not None else range(n + 1)
    for k in candidates:
        if _mlp_layer_types(n, num_experts, k, freq) == types:
            return k
    if given is not None:
        raise ValueError(f"mlp_layer_types: {list(types)!r} disagrees with "
                         f"first_k_dense_replace={given}, moe_layer_freq={freq}, "
                         f"num_experts={num_experts}")
    raise ValueError(f"mlp_layer_types: {list(types)!r} is not expressible as "
                     f"first_k_dense_replace with moe_layer_freq={freq}, "
                     f"num_experts={num_experts}")
