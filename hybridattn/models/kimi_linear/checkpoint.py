"""Hugging Face checkpoint directories: :func:`load`, :func:`save_pretrained` and the
safetensors I/O behind them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array
from safetensors import safe_open
from safetensors.numpy import save_file

from hybridattn.config import KimiLinearConfig
from hybridattn.models.kimi_linear.layout import to_checkpoint
from hybridattn.models.kimi_linear.params import _MAX_PROBLEMS, _keeps_f32, param_shapes
from hybridattn.models.kimi_linear.partitioning import param_shardings
from hybridattn.models.kimi_linear.primitives import Params
from servecore.progress import progress_bar
from servecore.prompts import load_tokenizer as _load_tokenizer

__all__ = [
    "from_checkpoint",
    "load",
    "load_tokenizer",
    "save_pretrained",
]

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# transformers writes a dense layer's MLP under block_sparse_moe; the release under mlp.
_DENSE_ALIAS = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.(gate_proj|up_proj|down_proj)"
                          r"\.weight")


def _expected_tensors(config: KimiLinearConfig) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` of a checkpoint of ``config``, named as ``to_checkpoint``
    names them (run on zero-strided placeholders, so nothing is allocated)."""
    ghost = jax.tree.map(lambda x: np.broadcast_to(np.zeros((), np.float32), x.shape),
                         param_shapes(config))
    return {name: a.shape for name, a in to_checkpoint(ghost).items()}


def _accepted_shapes(name: str, want: tuple[int, ...],
                     config: KimiLinearConfig) -> tuple[tuple[int, ...], ...]:
    """Shapes a checkpoint may store ``name`` in: the released one, plus the flat ``A_log
    [H]`` and the per-head ``dt_bias [H, Dk]`` of other writers (read as the released ones)."""
    leaf = name.rsplit(".", 1)[-1]
    H, Dk = config.linear_num_heads, config.linear_head_dim
    if leaf == "A_log":
        return want, (H,)
    if leaf == "dt_bias":
        return want, (H, Dk)
    return (want,)


def _canonical_names(names, config: KimiLinearConfig) -> dict[str, str]:
    """``{released name: name in the file}``: a dense layer's MLP may be stored under
    ``block_sparse_moe.`` (transformers) instead of ``mlp.`` (the release). A tied
    ``lm_head.weight`` is dropped."""
    out: dict[str, str] = {}
    for name in names:
        canon = name
        m = _DENSE_ALIAS.fullmatch(name)
        if m and int(m[1]) < config.num_hidden_layers and not config.is_moe_layer(int(m[1])):
            canon = f"model.layers.{m[1]}.mlp.{m[2]}.weight"
        if canon == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if canon in out:
            raise ValueError(f"tensors {out[canon]!r} and {name!r} are both {canon!r}")
        out[canon] = name
    return out


def _check_tensors(found: Mapping[str, tuple[tuple[int, ...], bool]], names: Mapping[str, str],
                   config: KimiLinearConfig, source: str) -> None:
    """Check ``found`` (``{released name: (shape, is floating)}``) against the tensors a
    checkpoint of ``config`` holds; one ValueError lists every missing, unexpected,
    wrong-shape or non-floating tensor (by its name in the file, ``names``)."""
    expected = _expected_tensors(config)
    problems = []
    for name, want in expected.items():
        if name not in found:
            problems.append(f"missing tensor {name!r} (expected shape {want})")
            continue
        shape, floating = found[name]
        if shape not in _accepted_shapes(name, want, config):
            problems.append(f"tensor {names[name]!r} has shape {shape}, expected {want}")
        elif not floating:
            problems.append(f"tensor {names[name]!r} (shape {shape}) is not floating point")
    for name in found.keys() - expected.keys():
        problems.append(f"unexpected tensor {names[name]!r} of shape {found[name][0]}")
    if problems:
        more = len(problems) - _MAX_PROBLEMS
        raise ValueError(
            f"{source} does not match the config ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems[:_MAX_PROBLEMS])
            + (f"\n  ... and {more} more" if more > 0 else "")
        )


def _float_dtype(dtype, what: str):
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{what} must be a floating dtype, got {dtype!r}")
    return np.dtype(dtype)


def _unflatten(node, prefix: str, fetch: Callable[[str], np.ndarray]):
    """Rebuild the ``node`` subtree of ``param_shapes`` from checkpoint tensors (the
    inverse of ``to_checkpoint``'s walk; routed experts re-stacked)."""
    if isinstance(node, dict):
        if prefix.endswith("block_sparse_moe.experts"):
            return {name: np.stack([fetch(f"{prefix}.{e}.{name}.weight")
                                    for e in range(spec.shape[0])])
                    for name, spec in node.items()}
        return {key: _unflatten(child, f"{prefix}.{key}" if prefix else key, fetch)
                for key, child in node.items()}
    if isinstance(node, list):
        return [_unflatten(child, f"{prefix}.{i}", fetch) for i, child in enumerate(node)]
    return fetch(prefix)


def _assemble(get: Callable[[str], np.ndarray], found, names, config: KimiLinearConfig,
              dtype, source: str, progress: bool = False, shardings=None) -> Params:
    """Check the tensors ``found`` and read them (``get(name in the file)``) into params,
    each placed with its ``shardings`` leaf when given (host -> its devices' shards);
    ``progress``: a bar of the tensors read."""
    dt = _float_dtype(dtype, "dtype")
    _check_tensors(found, names, config, source)
    expected = _expected_tensors(config)
    bar = progress_bar(total=len(expected), unit="tensor", desc=f"reading {source}",
                       enabled=progress, leave=False)

    def fetch(name):
        a = np.asarray(get(names[name])).reshape(expected[name])
        bar.update(1)
        return a.astype(np.float32 if _keeps_f32(name) else dt, copy=False)

    with bar:
        host = _unflatten(param_shapes(config), "", fetch)
    if shardings is None:
        return jax.tree.map(jnp.asarray, host)
    return jax.tree.map(jax.device_put, host, shardings)


def from_checkpoint(tensors: Mapping[str, np.ndarray | Array], config: KimiLinearConfig,
                    dtype=jnp.float32) -> Params:
    """Parameters in the ``init_params`` layout from a flat ``{tensor name: array}`` in
    the released naming (the inverse of ``to_checkpoint``).

    Routed experts are re-stacked; floating tensors are cast to ``dtype`` except ``A_log``,
    ``dt_bias`` and ``e_score_correction_bias`` (float32). A dense layer's MLP may be named
    ``block_sparse_moe.{gate,up,down}_proj`` (as transformers writes it); ``lm_head.weight``
    is ignored when ``tie_word_embeddings``. Missing, unexpected or wrong-shape tensors raise
    one ValueError naming each.

    >>> from hybridattn.models.kimi_linear import init_params
    >>> cfg = KimiLinearConfig.tiny()
    >>> p = init_params(cfg, jax.random.key(0))
    >>> q = from_checkpoint(to_checkpoint(p), cfg)
    >>> all(jax.tree.leaves(jax.tree.map(np.array_equal, p, q)))
    True
    """
    names = _canonical_names(tensors, config)
    found = {c: (tuple(np.shape(tensors[n])),
                 bool(jnp.issubdtype(tensors[n].dtype, jnp.floating)))
             for c, n in names.items()}
    return _assemble(tensors.__getitem__, found, names, config, dtype, "checkpoint")


def _weight_files(path: str) -> tuple[dict[str, str] | None, str]:
    """``(weight_map, source)``: the index's ``{tensor name: shard file}`` and the index's
    path, or ``(None, path of model.safetensors)`` for a single-file checkpoint."""
    index = os.path.join(path, _INDEX_FILE)
    single = os.path.join(path, _SINGLE_FILE)
    if os.path.isfile(index):
        with open(index) as fh:
            weight_map = json.load(fh).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map' of tensor names to files")
        return weight_map, index
    if os.path.isfile(single):
        return None, single
    raise FileNotFoundError(f"checkpoint directory {path!r} has neither {_SINGLE_FILE} nor "
                            f"{_INDEX_FILE}")


def load(path: str | os.PathLike[str], dtype=jnp.float32, *, mesh=None,
         progress: bool = False) -> tuple[KimiLinearConfig, Params]:
    """Read a Hugging Face checkpoint directory: ``(config, params)``.

    ``path`` holds ``config.json`` and ``model.safetensors`` or shards listed by
    ``model.safetensors.index.json``. Every tensor's name and shape is checked against the
    config before any is read (see ``from_checkpoint`` for the naming, dtypes and
    errors). Params come out in the ``init_params`` layout, floating tensors in ``dtype``
    but for the float32 ``A_log``, ``dt_bias`` and ``e_score_correction_bias``. With a
    ``(data, tensor)`` ``mesh`` each tensor goes from the file straight to its shards on
    the mesh (``partitioning.param_shardings``), never whole onto one device.
    ``progress`` shows the tensors read as a tqdm bar on stderr when it is a terminal. The
    directory's tokenizer, if it ships one, is ``load_tokenizer``'s.

    A round trip through ``save_pretrained``:

    >>> from hybridattn.models.kimi_linear import init_params
    >>> import tempfile
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> params = init_params(cfg, jax.random.key(0))
    >>> with tempfile.TemporaryDirectory() as path:
    ...     save_pretrained(params, cfg, path)
    ...     config, loaded = load(path, dtype=jnp.bfloat16)
    >>> config == cfg
    True
    >>> attn = loaded["model"]["layers"][0]["self_attn"]
    >>> attn["q_proj"]["weight"].dtype, attn["A_log"].dtype
    (dtype(bfloat16), dtype('float32'))
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"checkpoint directory {path!r} has no config.json")
    config = KimiLinearConfig.from_pretrained(path)
    weight_map, source = _weight_files(path)
    with contextlib.ExitStack() as stack:
        files = sorted(set(weight_map.values())) if weight_map else [_SINGLE_FILE]
        handles = {}
        for f in files:
            file_path = os.path.join(path, f)
            if not os.path.isfile(file_path):
                raise FileNotFoundError(f"{file_path} (listed in {source}) does not exist")
            handles[f] = stack.enter_context(safe_open(file_path, framework="np"))
        where: dict[str, str] = {}
        for f, h in handles.items():
            for name in h.keys():
                if name in where:
                    raise ValueError(f"tensor {name!r} is in both {where[name]} and {f}")
                where[name] = f
        if weight_map is not None:
            for name, f in weight_map.items():
                if name not in where:
                    raise ValueError(f"{source} lists tensor {name!r} in {f}, which does not "
                                     f"hold it")
                if where[name] != f:
                    raise ValueError(f"{source} lists tensor {name!r} in {f}, but it is in "
                                     f"{where[name]}")
            unlisted = sorted(where.keys() - weight_map.keys())
            if unlisted:
                raise ValueError(f"tensor {unlisted[0]!r} of {where[unlisted[0]]} is not in "
                                 f"{source}")
        names = _canonical_names(where, config)
        found = {}
        for c, n in names.items():
            sl = handles[where[n]].get_slice(n)
            dt = sl.get_dtype()
            found[c] = (tuple(sl.get_shape()), dt.startswith("F") or dt == "BF16")
        shardings = None
        if mesh is not None:
            shardings = param_shardings(config, mesh, dtype)
        params = _assemble(lambda n: handles[where[n]].get_tensor(n), found, names, config,
                           dtype, path, progress, shardings)
    return config, params


def load_tokenizer(path: str | os.PathLike[str], *, trust_remote_code: bool = False):
    """The tokenizer a checkpoint directory ships, or ``None`` when it has none (serve token
    ids then): transformers' ``AutoTokenizer`` on the local files
    (``servecore.prompts.load_tokenizer``). Give it to ``hybridattn.Engine(...,
    tokenizer=...)`` for text and chat prompts.

    The released Kimi-Linear's tokenizer is code that ships with the checkpoint
    (``tokenization_kimi.py``, on ``tiktoken``): it loads only with ``trust_remote_code=True``
    (a ``ValueError`` says so otherwise) and ``pip install tiktoken`` (an ``ImportError``
    names it otherwise).

    >>> from hybridattn.models.kimi_linear import init_params
    >>> import tempfile
    >>> from servecore.testing import save_word_tokenizer
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> with tempfile.TemporaryDirectory() as path:
    ...     save_pretrained(init_params(cfg, jax.random.key(0)), cfg, path)
    ...     ids_only = load_tokenizer(path)      # config.json and weights: no tokenizer
    ...     save_word_tokenizer(path, 64)        # tokenizer.json, tokenizer_config.json
    ...     tok = load_tokenizer(path)
    >>> ids_only is None, tok.encode("w6 w7"), tok.eos_token_id
    (True, [6, 7], 1)
    """
    return _load_tokenizer(path, trust_remote_code=trust_remote_code)


def save_pretrained(params: Params, config: KimiLinearConfig, path: str | os.PathLike[str], *,
                    dtype=None, max_shard_bytes: int | None = None) -> None:
    """Write ``params`` as a Hugging Face checkpoint directory readable by ``load``,
    mlx-lm and transformers: ``config.json`` plus ``model.safetensors``, or, when the tensors
    exceed ``max_shard_bytes``, shards ``model-0000i-of-0000N.safetensors`` and
    ``model.safetensors.index.json``.

    Tensor names are ``to_checkpoint``'s (the release's). ``dtype`` (e.g.
    ``jnp.bfloat16``) casts every tensor but ``A_log``, ``dt_bias`` and
    ``e_score_correction_bias``, which are written float32; ``None`` writes each as it is.
    ``params`` are checked against ``config`` first. A previous checkpoint's weight files in
    ``path`` are removed.

    >>> from hybridattn.models.kimi_linear import init_params
    >>> import tempfile
    >>> cfg = KimiLinearConfig.tiny(num_hidden_layers=2, hidden_size=32, vocab_size=64)
    >>> params = init_params(cfg, jax.random.key(0))
    >>> with tempfile.TemporaryDirectory() as path:
    ...     save_pretrained(params, cfg, path, max_shard_bytes=150_000)
    ...     files = sorted(os.listdir(path))
    ...     _, loaded = load(path)
    >>> files
    ['config.json', 'model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors',
     'model.safetensors.index.json']
    >>> all(jax.tree.leaves(jax.tree.map(np.array_equal, params, loaded)))
    True
    """
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    dt = None if dtype is None else _float_dtype(dtype, "dtype")
    flat = to_checkpoint(params)
    found = {n: (a.shape, bool(jnp.issubdtype(a.dtype, jnp.floating))) for n, a in flat.items()}
    _check_tensors(found, {n: n for n in flat}, config, "params")

    def cast(name, a):
        if dt is not None:
            a = a.astype(np.float32 if _keeps_f32(name) else dt)
        return np.ascontiguousarray(a)

    tensors = {name: cast(name, a) for name, a in flat.items()}
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, a in tensors.items():
        if shards[-1] and max_shard_bytes is not None and size + a.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += a.nbytes

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(path):
        if f in (_SINGLE_FILE, _INDEX_FILE) or _SHARD_FILE.fullmatch(f):
            os.remove(os.path.join(path, f))
    config.save_pretrained(path)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, _SINGLE_FILE), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        f = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, f), metadata=meta)
        weight_map.update(dict.fromkeys(shard, f))
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": weight_map}
    with open(os.path.join(path, _INDEX_FILE), "w") as fh:
        json.dump(index, fh, indent=2)
        fh.write("\n")
