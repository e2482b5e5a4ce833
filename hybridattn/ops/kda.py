"""KDA (Kimi Delta Attention) kernels in plain JAX.

Every KDA layer of a Kimi-Linear model runs through these functions. All of them are pure,
jit-compatible and differentiable; inputs may be bf16 or f32, the recurrent state and every
accumulation are f32.

Layouts (per token, heads before channels)::

    q, k   [B, T, H, Dk]   L2-normalised query / key (see :func:`l2norm`)
    v      [B, T, H, Dv]
    g      [B, T, H, Dk]   per-channel log-decay, <= 0 (see :func:`kda_gate`)
    beta   [B, T, H]       write strength in [0, 1]
    state  [B, H, Dk, Dv]  float32; rows (Dk) decay, the delta rule writes k (x) u

The recurrence, per head (as in ``docs/design.md``, *The model, from the cache's point of
view*)::

    S' = diag(exp(g_t)) S_{t-1}
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = scale * S_t^T q_t                         # read after the write

:func:`kda_recurrent` is the step-by-step reference; :func:`kda_chunked` is the fast
chunkwise-parallel form (any ``T``, packed variable-length batches, states at chunk
boundaries); :func:`kda_decode` is one step for many requests.

How the chunked form stays exact and overflow-free
--------------------------------------------------
Within a chunk of ``C`` tokens let ``G`` be the inclusive cumulative sum of ``g`` (so ``G`` is
non-increasing). The intra-chunk interactions need ``exp(G_i - G_j)`` for ``j <= i``. Real
checkpoints have per-token ``|g|`` in the thousands, so ``exp(G_i)`` and ``exp(-G_j)`` must
never be formed separately. The lower-triangular ``[C, C]`` matrices are built bottom-up over
block sizes ``s = 1, 2, 4, ..., C/2``: each ``2s`` block gains its lower-left ``s x s``
quadrant (rows in the second half, columns in the first), whose factors go through the
reference point ``r`` between the halves, ``exp(G_i - G_r) * exp(G_r - G_j)``. Both exponents
are ``<= 0``, so each factor is in ``[0, 1]`` and the product only underflows where the true
value does; the quadrant itself is one batched matmul. The factors are never exponentials of
cumulative sums: they are products of the per-token decays ``exp(g_t)`` (each in ``[0, 1]``),
kept per block and extended across the other half at every merge, so they stay precise (a
few ulp) even after huge decays, and ``exp`` runs once per input element.

The delta rule inside a chunk is the WY/UT transform: ``(I + L) [W, U] = diag(beta) [Ke, V]``
with ``Ke = exp(G) * K`` and ``L_ij = beta_i sum_d k_id k_jd exp(G_id - G_jd)`` (``j < i``), so
``W = Tb Ke`` and ``U = Tb V`` with ``Tb = (I + L)^-1 diag(beta)``; ``(I + L)^-1`` is built by
the same block recursion (``[[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]``).
Everything that depends on the chunk's start state ``S`` is linear in it::

    V'      = U - Tb (Ke S)                             the chunk's corrected values
    S_next  = exp(G_last) * S + Kt^T V',                Kt = exp(G_last - G) * K
    O_chunk = Qs S + A_qk V',                           Qs = scale exp(G) * Q

so the decays, ``(I + L)^-1``, ``U`` and ``A_qk`` are computed for many chunks at once, and the
only sequential work is ``[Ke; Qs] @ S``, ``Tb @ (Ke S)`` and ``Kt^T @ V'`` per chunk, in one
``lax.scan`` over groups of chunks sized to stay in cache; ``A_qk @ V'`` then runs for the
whole group at once. Each chunk's ``[Ke; Qs]``, ``Tb`` and ``Kt`` are built elementwise right
where its state pass needs them (a slice of a group-wide array would be one more copy).
(``W = Tb Ke`` itself is never formed: ``Tb (Ke S)`` costs the same matmul FLOPs when ``Dk =
Dv``, and ``[Ke; Qs]`` is built elementwise, where ``[W; Qs]`` needed a product and a copy.)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = [
    "ChunkStates",
    "kda_chunked",
    "kda_decode",
    "kda_gate",
    "kda_recurrent",
    "l2norm",
]

# Tokens x heads handled together by one step of the chunk scan: enough to batch the small
# matmuls, few enough that each [chunks, C, D] intermediate of a step (256 KiB at D = 128)
# stays in a core's L2 cache. Measured on a 2-core CPU at D = 128 (paired rounds): 512 beat
# 256 at chunk sizes 32, 64 and 128, and beat 1024 at 32 and 128 (a tie at 64).
_GROUP_TOKEN_HEADS = 512

class ChunkStates(NamedTuple):
    """Recurrent states at chunk boundaries, as returned by ``kda_chunked(...,
    return_chunk_states=True)``.

    ``states[b, n]`` is the state of sequence ``seq_ids[b, n]`` after its first
    ``num_tokens[b, n]`` tokens. Without ``cu_seqlens`` the chunks of row ``b`` are
    ``[n*C, (n+1)*C)``; with ``cu_seqlens`` (``B == 1``) chunks are laid out sequence after
    sequence, each sequence starting on a fresh chunk, and unused trailing chunks have
    ``seq_ids == -1``.

    Two packed sequences of 3 and 7 tokens with ``chunk_size=4``: the first fits one chunk,
    the second takes two, and the last chunk is unused:

    >>> B, T, H, D = 1, 10, 1, 4
    >>> q = k = l2norm(jnp.ones((B, T, H, D)))
    >>> v, g, beta = jnp.ones((B, T, H, D)), -jnp.ones((B, T, H, D)), jnp.ones((B, T, H))
    >>> run = jax.jit(kda_chunked, static_argnames=("chunk_size", "return_chunk_states"))
    >>> o, final, cs = run(q, k, v, g, beta, chunk_size=4, cu_seqlens=jnp.array([0, 3, 10]),
    ...                    return_chunk_states=True)
    >>> final.shape, cs.states.shape  # [N, H, Dk, Dv], [B, NC, H, Dk, Dv]
    ((2, 1, 4, 4), (1, 4, 1, 4, 4))
    >>> cs.seq_ids.tolist(), cs.num_tokens.tolist()
    ([[0, 1, 1, -1]], [[3, 4, 7, 0]])
    """

    states: Float[Array, "B NC H Dk Dv"]
    seq_ids: Int[Array, "B NC"]
    num_tokens: Int[Array, "B NC"]


# --------------------------------------------------------------------------------------------
# small pieces
# --------------------------------------------------------------------------------------------


def l2norm(x: Float[Array, "*batch D"], eps: float = 1e-6) -> Float[Array, "*batch D"]:
    """``x / sqrt(sum(x**2) + eps)`` over the last axis, computed in f32, returned in
    ``x.dtype``. This is the normalisation Kimi-Linear applies to q and k (``eps`` is added to
    the sum of squares, as in flash-linear-attention's ``l2norm``).

    >>> l2norm(jnp.array([3.0, 4.0]), eps=0.0)
    Array([0.6, 0.8], dtype=float32)
    """
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def kda_gate(
    a: Float[Array, "*batch H Dk"],
    A_log: Float[Array, "..."],
    dt_bias: Float[Array, "..."],
    lower_bound: float | None = None,
) -> Float[Array, "*batch H Dk"]:
    """The KDA per-channel log-decay ``g`` (float32, ``<= 0``).

    ``a`` is the gate projection ``f_b_proj(f_a_proj(x))`` reshaped to ``[..., H, Dk]``;
    ``A_log`` has ``H`` elements (checkpoint shape ``[1, 1, H, 1]``, or ``[H]``), ``dt_bias``
    ``H * Dk`` (``[H * Dk]`` or ``[H, Dk]``). Two formulas (the first as in ``docs/design.md``)::

        g = -exp(A_log) * softplus(a + dt_bias)                        # lower_bound is None
        g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias))          # lower_bound < 0

    >>> g = kda_gate(jnp.zeros((2, 3, 4)), jnp.zeros(3), jnp.zeros(12))
    >>> g.shape, bool((g <= 0).all())
    ((2, 3, 4), True)
    """
    H, Dk = a.shape[-2:]
    if A_log.size != H:
        raise ValueError(f"A_log has {A_log.size} elements (shape {A_log.shape}), expected H={H}")
    if dt_bias.size != H * Dk:
        raise ValueError(
            f"dt_bias has {dt_bias.size} elements (shape {dt_bias.shape}), "
            f"expected H*Dk={H * Dk}"
        )
    rate = jnp.exp(A_log.astype(jnp.float32).reshape(H, 1))
    x = a.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(H, Dk)
    if lower_bound is None:
        return -rate * jax.nn.softplus(x)
    if lower_bound >= 0:
        raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    return lower_bound * jax.nn.sigmoid(rate * x)


def _default_scale(scale: float | None, dk: int) -> float:
    return dk**-0.5 if scale is None else float(scale)


# --------------------------------------------------------------------------------------------
# the reference recurrence and decode
# --------------------------------------------------------------------------------------------


def _kda_step(state, q, k, v, g, beta, scale):
    """One delta-rule step for ``[..., H, D]`` f32 inputs; returns ``(new_state, o)``."""
    state = state * jnp.exp(g)[..., :, None]
    kv = jnp.einsum("...k,...kv->...v", k, state)
    u = beta[..., None] * (v - kv)
    state = state + k[..., :, None] * u[..., None, :]
    o = scale * jnp.einsum("...k,...kv->...v", q, state)
    return state, o


def _varying_like(x, *refs):
    """``x`` made to vary over every ``shard_map`` mesh axis that one of ``refs`` varies over.

    Inside ``jax.shard_map`` a ``lax.scan`` carry must vary over the same mesh axes as what the
    body returns, and a carry that starts as fresh zeros varies over none. Adding a zero built
    from each reference (``zeros_like`` keeps its axes) fixes that; outside ``shard_map`` XLA
    folds the additions away."""
    for r in refs:
        x = x + jnp.zeros_like(r, shape=x.shape, dtype=x.dtype)
    return x


def _initial_state(state, shape, what=""):
    """``state`` as f32 of ``shape`` (zeros if ``None``), or a ValueError naming the shape."""
    if state is None:
        return jnp.zeros(shape, jnp.float32)
    if state.shape != shape:
        raise ValueError(f"initial_state has shape {state.shape}, expected {shape}{what}")
    return state.astype(jnp.float32)


def _check_qkv(q, k, v, g, beta):
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must share a shape, got q{q.shape} k{k.shape} g{g.shape}")
    if v.shape[:-1] != q.shape[:-1] or beta.shape != q.shape[:-1]:
        raise ValueError(
            f"v / beta must match q on the leading axes {q.shape[:-1]}, "
            f"got v{v.shape} beta{beta.shape}"
        )


def kda_recurrent(
    q: Float[Array, "B T H Dk"],
    k: Float[Array, "B T H Dk"],
    v: Float[Array, "B T H Dv"],
    g: Float[Array, "B T H Dk"],
    beta: Float[Array, "B T H"],
    scale: float | None = None,
    initial_state: Float[Array, "B H Dk Dv"] | None = None,
) -> tuple[Float[Array, "B T H Dv"], Float[Array, "B H Dk Dv"]]:
    """Step-by-step KDA (a ``lax.scan`` over ``T``): the reference every other path must meet.

    Returns ``(o, final_state)``; ``o`` has ``v.dtype``, the state is float32. ``scale``
    defaults to ``Dk ** -0.5``.

    >>> B, T, H, D = 1, 5, 2, 4
    >>> q = k = l2norm(jnp.ones((B, T, H, D)))
    >>> o, s = kda_recurrent(q, k, jnp.ones((B, T, H, D)), -jnp.ones((B, T, H, D)),
    ...                      jnp.full((B, T, H), 0.5))
    >>> o.shape, s.shape
    ((1, 5, 2, 4), (1, 2, 4, 4))
    """
    _check_qkv(q, k, v, g, beta)
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    scale = _default_scale(scale, Dk)
    f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)  # time-major for the scan
    S0 = _initial_state(initial_state, (B, H, Dk, Dv))

    def body(state, xs):
        return _kda_step(state, *xs, scale)

    S0 = _varying_like(S0, q, k, v, g, beta)
    final, o = jax.lax.scan(body, S0, (f32(q), f32(k), f32(v), f32(g), f32(beta)))
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), final


def recurrent_steps(q, k, v, g, beta, initial_state, steps):
    """``kda_recurrent`` over the first ``steps`` (a traced int at most ``T``) of ``T``
    time-major f32 inputs (``[T, B, H, D]``): ``(o [T, B, H, Dv], final)``, ``o`` zero past
    ``steps``. Where every token past ``steps`` is neutral (``k = 0``, ``g = 0``) that is
    ``kda_recurrent`` over all ``T`` exactly: such a token leaves the state as it is and
    outputs ``q . S``, zero for ``q = 0``."""
    scale = _default_scale(None, q.shape[-1])
    out = _varying_like(jnp.zeros(v.shape, jnp.float32), q, k, v, g, beta)
    state = _varying_like(initial_state.astype(jnp.float32), q, k, v, g, beta)

    def body(t, carry):
        state, out = carry
        state, o = _kda_step(state, q[t], k[t], v[t], g[t], beta[t], scale)
        return state, jax.lax.dynamic_update_index_in_dim(out, o, t, 0)

    state, out = jax.lax.fori_loop(0, steps, body, (state, out))
    return out, state


def kda_decode(
    q: Float[Array, "B H Dk"],
    k: Float[Array, "B H Dk"],
    v: Float[Array, "B H Dv"],
    g: Float[Array, "B H Dk"],
    beta: Float[Array, "B H"],
    state: Float[Array, "B H Dk Dv"],
    scale: float | None = None,
) -> tuple[Float[Array, "B H Dv"], Float[Array, "B H Dk Dv"]]:
    """One KDA token for each of ``B`` requests: ``(o, new_state)``.

    The state layout is the one :func:`kda_chunked` returns, so ``prefill(T)`` followed by
    ``kda_decode`` equals ``prefill(T + 1)``.

    >>> s = jnp.zeros((3, 2, 4, 4))
    >>> o, s = kda_decode(*(jnp.full((3, 2, 4), 0.5),) * 3, -jnp.ones((3, 2, 4)),
    ...                   jnp.ones((3, 2)), s)
    >>> o.shape
    (3, 2, 4)
    """
    _check_qkv(q, k, v, g, beta)
    scale = _default_scale(scale, q.shape[-1])
    f32 = lambda x: x.astype(jnp.float32)
    new_state, o = _kda_step(
        state.astype(jnp.float32), f32(q), f32(k), f32(v), f32(g), f32(beta), scale
    )
    return o.astype(v.dtype), new_state


# --------------------------------------------------------------------------------------------
# the chunkwise-parallel form
# --------------------------------------------------------------------------------------------


def _intra_chunk(q, k, v, g, beta, scale):
    """Per-chunk quantities for ``N`` independent chunks (all batch axes flattened).

    Inputs are f32 ``q, k, g [N, C, Dk]``, ``v [N, C, Dv]``, ``beta [N, C]`` with ``C`` a power
    of two. Returns ``(E, F, T_inv, A_qk, U)``: the decays ``E = exp(G)`` and ``F =
    exp(G_last - G)`` ``[N, C, Dk]`` (``G`` the chunk's inclusive cumulative log-decay),
    ``T_inv = (I + L)^-1 [N, C, C]``, ``A_qk [N, C, C]`` (scaled) and ``U = Tb @ v [N, C, Dv]``
    as in the module docstring. :func:`_state_operands` turns a chunk's ``E, F, T_inv`` into
    the operands of its state pass.

    ``A_qk`` and the inverse of ``I + L`` (``L = diag(beta) A_kk``, whose blocks are only
    needed on the way) are built bottom-up over block sizes ``1, 2, 4, ..., C/2``: at block
    size ``s`` every ``2s`` block gains its lower-left ``s x s`` quadrant, whose decay factors
    go through the reference point between the two halves, so every exponent is ``<= 0``.
    Those factors are products of ``exp(g)``: ``E`` holds the decay from the start of each
    block through token ``i``, ``F`` the decay after token ``j`` to the end of its block.
    """
    N, C, Dk = k.shape
    # The diagonal, exp(G_i - G_i) = 1: q_i . k_i as a matrix-vector product, which XLA:CPU
    # runs in about half the time of jnp.sum(q * k, -1) (a reduction it also fed from
    # transposed copies of q and k).
    A_qk = ((q * k) @ jnp.ones((Dk,), jnp.float32))[:, :, None, None]
    T_inv = jnp.ones((N, C, 1, 1), jnp.float32)  # (I + L)^-1, block by block
    E = jnp.exp(g)  # decay from the start of the token's block through the token (inclusive)
    F = jnp.ones_like(E)  # decay after the token through the end of its block
    s = 1
    while s < C:
        nb = C // (2 * s)
        E2 = E.reshape(N, nb, 2, s, Dk)
        left = E2[:, :, 1]  # exp(G_i - G_r) for rows i of the second half
        k2 = k.reshape(N, nb, 2, s, Dk)
        q2 = q.reshape(N, nb, 2, s, Dk)
        lhs = jnp.concatenate([k2[:, :, 1] * left, q2[:, :, 1] * left], axis=2)
        F2 = F.reshape(N, nb, 2, s, Dk)
        rhs = jnp.swapaxes(k2[:, :, 0] * F2[:, :, 0], -1, -2)  # exp(G_r - G_j) for columns j
        off = jnp.matmul(lhs, rhs)  # [N, nb, 2s, s]
        off_kk, off_qk = off[:, :, :s], off[:, :, s:]
        L_off = beta.reshape(N, nb, 2, s)[:, :, 1, :, None] * off_kk
        T2 = T_inv.reshape(N, nb, 2, s, s)
        if s <= 4:  # s x s products this small run faster as multiply-reduce than as dots
            mm = lambda a, b: jnp.sum(a[..., :, :, None] * b[..., None, :, :], axis=-2)
            T_off = -mm(T2[:, :, 1], mm(L_off, T2[:, :, 0]))
        else:
            T_off = -jnp.matmul(T2[:, :, 1], jnp.matmul(L_off, T2[:, :, 0]))
        A_qk = _merge_blocks(A_qk, off_qk)
        T_inv = _merge_blocks(T_inv, T_off)
        # Merge the halves: the second half's rows also decay through the first half, the
        # first half's columns also through the second.
        first_total, second_total = E2[:, :, 0, -1:], left[:, :, -1:]
        E = jnp.concatenate([E2[:, :, 0], left * first_total], axis=2).reshape(N, C, Dk)
        F = jnp.concatenate([F2[:, :, 0] * second_total, F2[:, :, 1]], axis=2).reshape(N, C, Dk)
        s *= 2
    A_qk = scale * A_qk.reshape(N, C, C)
    T_inv = T_inv.reshape(N, C, C)

    # (I + L) [W, U] = diag(beta) [Ke, V]: Tb = (I + L)^-1 diag(beta).
    U = jnp.matmul(T_inv * beta[..., None, :], v)
    return E, F, T_inv, A_qk, U


def _state_operands(q, k, beta, E, F, T_inv, scale):
    """The operands of one chunk's state pass, for ``[..., C, D]`` slices of the inputs and of
    :func:`_intra_chunk`'s results: ``KQ = [Ke; Qs] [..., 2C, Dk]`` (both multiply the start
    state: one operand, one matmul), ``Tb [..., C, C]``, ``Kt = exp(G_last - G) K [..., C,
    Dk]`` and ``decay = exp(G_last) [..., Dk]``. For a chunk whose start state is ``S``, with
    ``V' = U - Tb @ (Ke @ S)``: ``o = Qs @ S + A_qk @ V'`` and ``S_next = decay[..., None] * S
    + Kt^T @ V'``.

    Built per chunk from the group-wide arrays, so each operand is written once, in its final
    place: slicing a chunk out of a group-wide ``KQ`` or ``Kt`` makes XLA copy the slice."""
    KQ = jnp.concatenate([E * k, scale * E * q], axis=-2)
    return KQ, T_inv * beta[..., None, :], k * F, E[..., -1, :]


def _merge_blocks(diag, off):
    """Lower-triangular ``[N, 2nb, s, s]`` diagonal blocks plus ``[N, nb, s, s]`` lower-left
    quadrants -> ``[N, nb, 2s, 2s]`` blocks."""
    N, n2, s, _ = diag.shape
    diag = diag.reshape(N, n2 // 2, 2, s, s)
    top = jnp.concatenate([diag[:, :, 0], jnp.zeros_like(diag[:, :, 0])], axis=-1)
    bottom = jnp.concatenate([off, diag[:, :, 1]], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)


def _packed_positions(cu_seqlens, B: int, T: int):
    """For ``N`` sequences packed along ``T`` (``B == 1``): ``(cu, seq, local)`` with ``seq``
    the sequence of every token and ``local`` its position within that sequence."""
    if B != 1:
        raise ValueError(f"cu_seqlens needs B == 1 (sequences packed along T), got B={B}")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be [N + 1] with N >= 1, got shape {cu_seqlens.shape}")
    N = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    tok = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu, tok, side="right") - 1, 0, N - 1).astype(jnp.int32)
    return cu, seq, tok - cu[seq]


def _check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size!r}")


def _chunked_core(q, k, v, g, beta, scale, C, S0, resets=None, init=None, n_seqs=0,
                  keep_states=False):
    """Chunked KDA over ``[B, T, H, D]`` f32 inputs (any ``T``; the tail is padded with
    neutral tokens).

    One ``lax.scan`` walks groups of ``G`` chunks: the intra-chunk pass runs on the whole
    group at once (``B*G*H`` chunks, small enough to stay in cache), then the state is carried
    through the group's chunks. ``S0 [B, H, Dk, Dv]``.

    Packed sequences (``B == 1``): ``resets [NC, 2]`` holds, per chunk, the sequence that
    starts there (its state comes from ``init [n_seqs, H, Dk, Dv]``) and the sequence that ends
    there (its final state is recorded), ``-1`` for none.

    Returns ``(o [B, T, H, Dv], final, S_out)``: ``final`` is the carried state ``[B, H, Dk,
    Dv]`` or, for packed sequences, the per-sequence final states ``[n_seqs, H, Dk, Dv]``;
    ``S_out [B, NC, H, Dk, Dv]`` (the state after every chunk) only with ``keep_states``.
    """
    B, Tp, H, Dk = q.shape
    Dv = v.shape[-1]
    NC = max(1, -(-Tp // C))
    G = max(1, min(NC, _GROUP_TOKEN_HEADS // (C * B * H)))
    NG = -(-NC // G)
    pad = NG * G * C - Tp
    if resets is not None:
        resets = jnp.pad(resets, ((0, NG * G - NC), (0, 0)), constant_values=-1)
        resets = resets.reshape(NG, G, 2)

    def to_chunks(x):  # [B, G*C, H, ...] -> [B*G*H, C, ...]
        x = jnp.moveaxis(x.reshape(B, G, C, H, *x.shape[3:]), 3, 2)
        return x.reshape(B * G * H, C, *x.shape[4:])

    inputs = [jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
              for x in (q, k, v, g, beta)]

    def body(carry, xs):
        S, finals = carry
        i, group_resets = xs
        # Slice the group out of the inputs in place (no transposed copy of the inputs).
        group = (jax.lax.dynamic_slice_in_dim(x, i * G * C, G * C, axis=1) for x in inputs)
        chunks = [to_chunks(x) for x in group]
        intra = _intra_chunk(*chunks, scale)
        # [B, G, H, ...]: index j picks chunk j of the group for every row and head.
        qc, kc, _, _, bc = (x.reshape(B, G, H, *x.shape[1:]) for x in chunks)
        E, F, T_inv, A_qk, U = (x.reshape(B, G, H, *x.shape[1:]) for x in intra)
        QS, V, S_out = [], [], []
        for j in range(G):
            if group_resets is not None:
                start, end = group_resets[j, 0], group_resets[j, 1]
                S = jnp.where(start >= 0, init[jnp.maximum(start, 0)][None], S)
            KQ, Tb, Kt, decay = _state_operands(
                qc[:, j], kc[:, j], bc[:, j], E[:, j], F[:, j], T_inv[:, j], scale)
            KS_QS = jnp.matmul(KQ, S)  # [B, H, 2C, Dv]
            QS.append(KS_QS[..., C:, :])
            V.append(U[:, j] - jnp.matmul(Tb, KS_QS[..., :C, :]))  # V' = U - Tb Ke S
            # Kt^T V' contracts the chunk's tokens in place (no transposed copy of Kt).
            S = decay[..., None] * S + jnp.einsum("bhcd,bhce->bhde", Kt, V[-1])
            if group_resets is not None:  # index n_seqs (out of range) drops the write
                finals = finals.at[jnp.where(end >= 0, end, n_seqs)].set(S[0], mode="drop")
            S_out.append(S)
        # The intra-chunk part of the output needs V', so it runs once for the whole group.
        o = jnp.stack(QS, axis=1) + jnp.matmul(A_qk, jnp.stack(V, axis=1))  # [B, G, H, C, Dv]
        o = jnp.moveaxis(o, 2, 3).reshape(B, G * C, H, Dv)
        return (S, finals), (o, jnp.stack(S_out, axis=1) if keep_states else None)

    finals = init if resets is not None else None
    S0 = _varying_like(S0, *inputs)
    finals = None if finals is None else _varying_like(finals, *inputs)
    xs = (jnp.arange(NG), resets)
    (S, finals), (o, S_out) = jax.lax.scan(body, (S0, finals), xs)
    ungroup = lambda x: x.reshape(B, NG * G, *x.shape[3:]) if B == 1 else jnp.moveaxis(
        x, 0, 1).reshape(B, NG * G, *x.shape[3:])
    o = ungroup(o.reshape(NG, B, G, C, H, Dv)).reshape(B, NG * G * C, H, Dv)[:, :Tp]
    if keep_states:
        S_out = ungroup(S_out)[:, :NC]
    return o, (S if resets is None else finals), S_out


def kda_chunked(
    q: Float[Array, "B T H Dk"],
    k: Float[Array, "B T H Dk"],
    v: Float[Array, "B T H Dv"],
    g: Float[Array, "B T H Dk"],
    beta: Float[Array, "B T H"],
    scale: float | None = None,
    initial_state: Float[Array, "N H Dk Dv"] | None = None,
    chunk_size: int = 64,
    cu_seqlens: Int[Array, " Np1"] | None = None,
    return_chunk_states: bool = False,
):
    """Chunkwise-parallel KDA, equal to :func:`kda_recurrent` (see the module docstring).

    * Any ``T`` (including ``T < chunk_size``); the tail chunk is padded with neutral tokens
      (``k = v = 0``, ``g = 0``, ``beta = 0``), which leave the state unchanged.
    * ``cu_seqlens`` (``[N + 1]`` int, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == T``) packs
      ``N`` variable-length sequences into ``B == 1``; then ``initial_state`` and the final
      state are ``[N, H, Dk, Dv]``. It may be a traced value: shapes depend only on ``T``,
      ``N`` and ``chunk_size``.
    * ``return_chunk_states=True`` also returns a :class:`ChunkStates` with the state at every
      chunk boundary (what a prefix cache snapshots).

    Returns ``(o, final_state)`` or ``(o, final_state, chunk_states)``; ``o`` has ``v.dtype``.

    >>> import numpy as np
    >>> B, T, H, D = 1, 20, 2, 8
    >>> x = jnp.asarray(np.random.default_rng(0).standard_normal((4, B, T, H, D)), jnp.float32)
    >>> q, k, v = l2norm(x[0]), l2norm(x[1]), x[2]
    >>> g = -jax.nn.softplus(x[3])  # log-decay <= 0
    >>> beta = jnp.full((B, T, H), 0.5)
    >>> o1, s1 = kda_chunked(q, k, v, g, beta, chunk_size=8)  # 3 chunks, the last one padded
    >>> o2, s2 = kda_recurrent(q, k, v, g, beta)
    >>> o1.shape, s1.shape
    ((1, 20, 2, 8), (1, 2, 8, 8))
    >>> bool(jnp.allclose(o1, o2, atol=1e-4)), bool(jnp.allclose(s1, s2, atol=1e-4))
    (True, True)
    """
    _check_qkv(q, k, v, g, beta)
    _check_chunk_size(chunk_size)
    B, T, H, Dk = q.shape
    scale = _default_scale(scale, Dk)
    f32 = lambda x: x.astype(jnp.float32)
    qkvgb = f32(q), f32(k), f32(v), f32(g), f32(beta)
    if cu_seqlens is None:
        o, final, cs = _chunked_dense(*qkvgb, scale, chunk_size, initial_state,
                                      return_chunk_states)
    else:
        o, final, cs = _chunked_packed(*qkvgb, scale, chunk_size, initial_state, cu_seqlens,
                                       return_chunk_states)
    o = o.astype(v.dtype)
    return (o, final, cs) if return_chunk_states else (o, final)


def _chunked_dense(q, k, vf, g, beta, scale, C, initial_state, keep_states):
    """:func:`kda_chunked` over ``B`` separate sequences: ``(o, final, chunk_states | None)``,
    ``o`` in float32."""
    B, T, H, Dk = q.shape
    Dv = vf.shape[-1]
    S0 = _initial_state(initial_state, (B, H, Dk, Dv))
    o, final, S_out = _chunked_core(q, k, vf, g, beta, scale, C, S0, keep_states=keep_states)
    if not keep_states:
        return o, final, None
    NC = S_out.shape[1]
    ends = jnp.minimum((jnp.arange(NC) + 1) * C, T).astype(jnp.int32)
    cs = ChunkStates(
        S_out,
        jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, NC)),
        jnp.broadcast_to(ends[None], (B, NC)),
    )
    return o, final, cs


def _chunked_packed(q, k, vf, g, beta, scale, C, initial_state, cu_seqlens, keep_states):
    """:func:`kda_chunked` over the ``N`` packed sequences of ``cu_seqlens`` (``B == 1``):
    each sequence starts on a fresh chunk of a buffer. ``(o, final, chunk_states | None)``,
    ``o`` in float32."""
    B, T, H, Dk = q.shape
    Dv = vf.shape[-1]
    cu, seq, local = _packed_positions(cu_seqlens, B, T)
    N = cu.shape[0] - 1
    init = _initial_state(initial_state, (N, H, Dk, Dv), " (one state per sequence of cu_seqlens)")
    lens = cu[1:] - cu[:-1]
    nchunks = -(-lens // C)  # chunks per sequence
    first_chunk = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nchunks)[:-1]])
    NCb = max(1, (T + N * (C - 1)) // C)  # static bound on sum(ceil(len / C))

    # Buffer position of each packed token: its sequence starts on a fresh chunk.
    dest = first_chunk[seq] * C + local

    def to_buf(x):
        buf = jnp.zeros((1, NCb * C) + x.shape[2:], x.dtype)
        return buf.at[0, dest].set(x[0], unique_indices=True, mode="drop")

    # Per buffer chunk: the sequence starting there and the sequence ending there (or -1).
    seq_ids = jnp.arange(N, dtype=jnp.int32)
    mark = lambda where: jnp.full((NCb,), -1, jnp.int32).at[
        jnp.where(lens > 0, where, NCb)].set(seq_ids, mode="drop")
    resets = jnp.stack([mark(first_chunk), mark(first_chunk + nchunks - 1)], axis=1)
    o_buf, final, S_out = _chunked_core(
        to_buf(q), to_buf(k), to_buf(vf), to_buf(g), to_buf(beta), scale, C,
        jnp.zeros((1, H, Dk, Dv), jnp.float32), resets=resets, init=init, n_seqs=N,
        keep_states=keep_states,
    )
    o = o_buf[:, dest]
    if not keep_states:
        return o, final, None
    return o, final, _packed_chunk_states(S_out, first_chunk, nchunks, lens, C)


def _packed_chunk_states(S_out, first_chunk, nchunks, lens, C):
    """The :class:`ChunkStates` of a packed buffer: which sequence owns each buffer chunk, and
    how many of its tokens it has consumed."""
    N = lens.shape[0]
    chunk = jnp.arange(S_out.shape[1], dtype=jnp.int32)
    owner = jnp.clip(jnp.searchsorted(first_chunk + nchunks, chunk, side="right"), 0, N)
    used = (owner < N) & (chunk >= first_chunk[jnp.minimum(owner, N - 1)])
    owner_c = jnp.minimum(owner, N - 1)
    consumed = jnp.minimum((chunk - first_chunk[owner_c] + 1) * C, lens[owner_c])
    return ChunkStates(
        S_out,
        jnp.where(used, owner_c, -1)[None],
        jnp.where(used, consumed, 0).astype(jnp.int32)[None],
    )
