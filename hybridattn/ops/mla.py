"""MLA attention over the paged latent pool, key block by key block.

The pool keeps, per MLA layer, ``c_kv [S, r]`` and ``k_pe [S, dr]`` of every token slot; a
request's tokens are the slots of its page-table row ``page_table[b, :seq_lens[b]]``. The
dense oracles :func:`ref_mla_extend` and :func:`ref_mla_decode` gather the whole row
(``[B, W, r]``), decompress it and take a ``[B, H, Q, W]`` score matrix: memory grows with
queries x width (a 128k prompt on the tiny config needs more than 12 GB). :func:`mla_extend`
and :func:`mla_decode` compute the same thing with workspace independent of ``W``:

1. **Work list.** Each request's queries are cut into query tiles of ``bq = min(query_block,
   Q)`` rows; tile ``t`` of request ``b`` sees keys ``0 .. prefix_b + min((t + 1) bq, ext_b)``
   (causal), so it has ``n[b, t] = ceil(that / bk)`` key blocks of ``bk = min(block_size, W)``
   tokens, and 0 when the tile has no query (``t bq >= ext_b``: padding rows and tiles past a
   short extend). The items are the ``(b, t, j)`` with ``j < n[b, t]``, numbered through
   ``cumsum(n)``; their count is a traced number, so a ``lax.while_loop`` walks exactly them:
   cost follows each request's own length, not the batch maximum, and blocks past
   ``seq_lens`` (and above the causal diagonal of a tile) are never visited.
2. **One item.** Slice the tile's ``bq`` queries out of the packed ``[T, H, .]`` inputs
   (``query_start[b] + t bq``), slice ``bk`` slot ids out of the page-table row and gather
   their latents ``[bk, r]`` / ``[bk, dr]`` from the pool (``c_kv`` zeroed where masked, and
   masked scores replaced, so a stale or sink slot never reaches the output, not even as
   ``0 * inf``). Scores ``[H, bq, bk]``, masked by ``key < seq_len``, causality and the
   tile's live rows. Everything inside the loop is head-major, so a tile's queries of all
   heads are one matrix ``[H bq, .]``: the absorbed form's products are plain matrix
   products, the decompressed form's batch over heads, and no item transposes its scores
   (2.5-4.5x faster than the token-major loop before it, tiny config, 16k prefix, Q = 256
   and 2048).
3. **Exact online softmax.** Per query row and head a running max ``m``, sum ``l`` and output
   accumulator ``acc`` (packed head-major, ``[H, T + bq, .]``, float32): ``m' = max(m, max_k s)``,
   ``p = exp(s - m')``, ``l' = l e^(m - m') + sum p``, ``acc' = acc e^(m - m') + p V``. A
   row that has seen no key keeps ``m = -inf`` and shifts by 0 instead, so large logits never
   overflow and fully masked rows end with ``l = 0`` and give zeros, as the dense softmax does.
   Only the tile's live rows are written back (the tile's other rows belong to the next
   request). At the end ``out = acc / l``.
4. **Two forms of one item.** *Absorbed*: the queries move into latent space once
   (``q_lat = q_nope W_kc``, ``[T, H, r]``), scores are taken against ``c_kv`` and ``k_pe``
   directly and the latent output maps back with ``W_vc`` after the loop. *Decompressed*: each
   key block is decompressed (``k_nope = c_kv W_kc^T``, ``v = c_kv W_vc^T``, ``[bk, H, d]``)
   and attention runs in head space. Per item the absorbed form costs ``bq bk H (2r + dr)``
   multiply-adds, the decompressed one ``bk H r (dn + dv) + bq bk H (dn + dr + dv)``: the
   decompression is paid once per key block and tile, so it wins for wide tiles.
   :func:`prefers_absorbed` is that rule (measured below); decode always runs absorbed.

Workspace: one item's scores ``[H, bq, bk]`` and (decompressed) K/V block ``[H, bk, dn + dv]``,
plus the accumulators ``[H, T + bq, r or dv]``: O(tokens in the batch + bq x bk x H), none of
it a multiple of ``W``. ``tests/hybridattn/test_mla_blockwise.py`` checks that on the compiled
forward of a 64k-wide page table.

Measured on a shared 2-core x86 CPU (float32, one request over a 16k cached prefix, blocks and
query tiles of 512; ``python -m hybridattn.bench mla forms``, more in ``docs/benchmarks.md``),
ms per extend, absorbed / decompressed:

- tiny (H=4, dn=dv=16, dr=8, r=32): Q=1 3.5 / 4.7, Q=64 51 / 71, Q=2048 919 / 5,108;
- Kimi-like (H=32, dn=dv=128, dr=64, r=512): Q=1 59 / 6,133, Q=64 2,500 / 8,328, Q=2048
  172,918 / 152,115.

On the Kimi-like shape both ran at 10-15 GMAC/s, so the multiply-add count decides; on the
tiny config's 16-wide heads the decompressed form's head-batched products ran ~10x slower,
so :func:`prefers_absorbed` sends narrow heads to the absorbed form always. (These forms
were timed with the token-major loop; the head-major one speeds the decompressed form's
products too, so the rule's 64-wide cut may move.) Blocks of 512 keys and tiles of 512
queries by default: a sweep on the tiny config, 16k prefix (ms, absorbed, one shared
machine), Q = 256, tiles of 256: blocks of 512 / 1024 / 2048 / 4096 took 134 / 131 / 143 /
187; Q = 2048, tiles of 512: 1004 / 970 / 755 / 835, tiles of 1024: 687 / 702 / 788 / 1028,
within the machine's noise of each other up to 2048 keys.

No Pallas kernel is dispatched to: JAX's ragged paged attention kernels (TPU) take K/V pages
with a head axis, not a shared latent; an MLA kernel over this pool's layout is left for later.
Every backend runs the plain JAX loop.

>>> S, r, dr, H, dn, dv = 16, 4, 2, 2, 3, 3
>>> ks = jax.random.split(jax.random.key(0), 6)
>>> c_kv, k_pe = jax.random.normal(ks[0], (S, r)), jax.random.normal(ks[1], (S, dr))
>>> w_kc, w_vc = jax.random.normal(ks[2], (H, dn, r)), jax.random.normal(ks[3], (H, dv, r))
>>> q_nope, q_pe = jax.random.normal(ks[4], (5, H, dn)), jax.random.normal(ks[5], (5, H, dr))
>>> page_table = jnp.array([[1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0]])  # [B, W]
>>> seq_lens, extend_lens = jnp.array([6, 3]), jnp.array([3, 1])  # 3 + 2 tokens cached
>>> query_start = jnp.array([0, 3])
>>> args = (q_nope, q_pe, c_kv, k_pe, w_kc, w_vc, page_table, seq_lens, extend_lens,
...         query_start)
>>> out = mla_extend(*args, max_extend_len=3, scale=0.4, block_size=2)
>>> want = ref_mla_extend(*args, max_extend_len=3, scale=0.4)
>>> out.shape, bool(jnp.allclose(out, want, atol=1e-5)), out[-1].tolist()  # last: padding
((5, 2, 3), True, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = [
    "mla_decode",
    "mla_extend",
    "prefers_absorbed",
    "ref_mla_decode",
    "ref_mla_extend",
]

# Shape aliases: T packed tokens (padding at the tail), B requests (padding rows included),
# W page-table width, S token slots of the pool, H heads, dn / dr / dv nope / rope / value
# head dims, r kv_lora_rank.

_F32 = jnp.float32


def prefers_absorbed(query_tile: int, *, qk_nope_head_dim: int, qk_rope_head_dim: int,
                     v_head_dim: int, kv_lora_rank: int) -> bool:
    """Whether key blocks run faster in absorbed form than decompressed, for ``query_tile``
    queries per item. Heads narrower than 64 (``dn`` or ``dv``): absorbed, always; the
    decompressed form's head-batched products of such heads ran about 10x below the absorbed
    form's plain ones on this CPU (tiny config: 1.1 vs 10.5 GMAC/s). Otherwise by the
    multiply-adds per key and head, ``bq (2r + dr) <= r (dn + dv) + bq (dn + dr + dv)``:
    absorbed up to about 180 queries per tile on a Kimi-like shape (module docstring).

    >>> kimi = dict(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512)
    >>> prefers_absorbed(1, **kimi), prefers_absorbed(64, **kimi), prefers_absorbed(512, **kimi)
    (True, True, False)
    >>> prefers_absorbed(512, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    ...                  kv_lora_rank=32)  # the tiny config
    True
    """
    dn, dr, dv, r = qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank
    if min(dn, dv) < 64:
        return True
    return query_tile * (2 * r + dr) <= r * (dn + dv) + query_tile * (dn + dr + dv)


# --------------------------------------------------------------------------------------------
# the dense oracles
# --------------------------------------------------------------------------------------------


def _pages(c_kv, k_pe, page_table, seq_lens, slot_offset=0):
    """Each request's latents ``[B, W, r]`` and rope keys ``[B, W, dr]`` (f32), zero past
    ``seq_lens`` so stale or sink slots never reach the output (not even as 0 * inf)."""
    live = (jnp.arange(page_table.shape[1]) < seq_lens[:, None])[..., None]
    slots = page_table + slot_offset
    ckv = jnp.where(live, c_kv[slots].astype(_F32), 0.0)
    kpe = jnp.where(live, k_pe[slots].astype(_F32), 0.0)
    return ckv, kpe


def _masked_softmax(scores, mask):
    scores = jnp.where(mask, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)  # fully masked (padding) rows stay finite
    p = jnp.where(mask, jnp.exp(scores - peak), 0.0)
    return p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)


def ref_mla_extend(
    q_nope: Float[Array, "T H dn"],
    q_pe: Float[Array, "T H dr"],
    c_kv: Float[Array, "S r"],
    k_pe: Float[Array, "S dr"],
    w_kc: Float[Array, "H dn r"],
    w_vc: Float[Array, "H dv r"],
    page_table: Int[Array, "B W"],
    seq_lens: Int[Array, " B"],
    extend_lens: Int[Array, " B"],
    query_start: Int[Array, " B"],
    *,
    max_extend_len: int,
    scale: float,
    slot_offset: int | Int[Array, ""] = 0,
) -> Float[Array, "T H dv"]:
    """Dense causal MLA over each request's whole page-table row (the oracle of
    :func:`mla_extend`; memory ``O(B Q H W)``). Request ``b``'s ``extend_lens[b]`` queries are
    tokens ``query_start[b]...`` of the packed inputs and positions ``seq_lens[b] -
    extend_lens[b]...``; its keys are slots ``page_table[b, :seq_lens[b]]`` of the pool, which
    already holds the new tokens. K/V are decompressed; padding tokens get zeros.
    ``slot_offset`` (every function here takes one) is added to each slot read: the pool of
    every MLA layer flattened to one table, a layer's rows start there
    (``pools.get_mla_kv_flat``).

    >>> out = ref_mla_extend(jnp.ones((2, 1, 2)), jnp.ones((2, 1, 1)), jnp.eye(3, 2, k=-1),
    ...                      jnp.zeros((3, 1)), jnp.ones((1, 2, 2)), jnp.eye(2)[None],
    ...                      jnp.array([[1, 2]]), jnp.array([2]), jnp.array([2]),
    ...                      jnp.array([0]), max_extend_len=2, scale=1.0)
    >>> out[:, 0].tolist()  # token 0 sees slot 1 only; token 1 averages slots 1 and 2
    [[1.0, 0.0], [0.5, 0.5]]
    """
    T = q_nope.shape[0]
    ckv, kpe = _pages(c_kv, k_pe, page_table, seq_lens, slot_offset)  # [B, W, r|dr]
    k_nope = jnp.einsum("bwr,hdr->bwhd", ckv, w_kc.astype(_F32))
    v = jnp.einsum("bwr,hdr->bwhd", ckv, w_vc.astype(_F32))
    # Queries of each request in a [B, Q] layout (Q = max_extend_len).
    Q = max_extend_len
    i = jnp.arange(Q, dtype=jnp.int32)
    rows = query_start[:, None] + i[None, :]  # [B, Q]
    valid = i[None, :] < extend_lens[:, None]
    rows_c = jnp.clip(rows, 0, T - 1)
    qn, qp = q_nope[rows_c].astype(_F32), q_pe[rows_c].astype(_F32)  # [B, Q, H, d]
    scores = jnp.einsum("bqhd,bwhd->bhqw", qn, k_nope) + jnp.einsum("bqhd,bwd->bhqw", qp, kpe)
    W = ckv.shape[1]
    qpos = (seq_lens - extend_lens)[:, None] + i[None, :]  # [B, Q]
    kpos = jnp.arange(W, dtype=jnp.int32)
    mask = (kpos[None, None, :] <= qpos[:, :, None]) & valid[:, :, None]
    p = _masked_softmax(scores * scale, mask[:, None])
    out = jnp.einsum("bhqw,bwhd->bqhd", p, v)  # [B, Q, H, dv]
    dest = jnp.where(valid, rows, T)  # invalid rows are dropped
    return jnp.zeros((T,) + out.shape[2:], _F32).at[dest].set(out, mode="drop")


def ref_mla_decode(
    q_nope: Float[Array, "B H dn"],
    q_pe: Float[Array, "B H dr"],
    c_kv: Float[Array, "S r"],
    k_pe: Float[Array, "S dr"],
    w_kc: Float[Array, "H dn r"],
    w_vc: Float[Array, "H dv r"],
    page_table: Int[Array, "B W"],
    seq_lens: Int[Array, " B"],
    *,
    scale: float,
    slot_offset: int | Int[Array, ""] = 0,
) -> Float[Array, "B H dv"]:
    """Dense MLA of one query per request (row ``b`` of the inputs) over all its
    ``seq_lens[b]`` keys, in absorbed form (the oracle of :func:`mla_decode`); rows with
    ``seq_lens == 0`` get zeros.

    >>> out = ref_mla_decode(jnp.ones((2, 1, 2)), jnp.ones((2, 1, 1)), jnp.eye(3, 2, k=-1),
    ...                      jnp.zeros((3, 1)), jnp.ones((1, 2, 2)), jnp.eye(2)[None],
    ...                      jnp.array([[1, 2], [0, 0]]), jnp.array([2, 0]), scale=1.0)
    >>> out[:, 0].tolist()  # row 1: a padding row
    [[0.5, 0.5], [0.0, 0.0]]
    """
    ckv, kpe = _pages(c_kv, k_pe, page_table, seq_lens, slot_offset)  # [B, W, r|dr]
    q_lat = jnp.einsum("bhd,hdr->bhr", q_nope.astype(_F32), w_kc.astype(_F32))
    scores = jnp.einsum("bhr,bwr->bhw", q_lat, ckv) + jnp.einsum(
        "bhd,bwd->bhw", q_pe.astype(_F32), kpe
    )
    kpos = jnp.arange(ckv.shape[1], dtype=jnp.int32)
    mask = kpos[None, None, :] < seq_lens[:, None, None]
    p = _masked_softmax(scores * scale, mask)
    o_lat = jnp.einsum("bhw,bwr->bhr", p, ckv)
    return jnp.einsum("bhr,hdr->bhd", o_lat, w_vc.astype(_F32))


# --------------------------------------------------------------------------------------------
# blockwise
# --------------------------------------------------------------------------------------------


def _cdiv(a, b):
    return (a + b - 1) // b


def _work_list(seq_lens, extend_lens, *, query_tile, num_tiles, block):
    """Step 1: ``n [B * num_tiles]``, the key blocks of each query tile (0 for a tile without
    queries), and ``ends = cumsum(n)``: item ``k`` belongs to the tile ``sum(ends <= k)``."""
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    seen = (seq_lens - extend_lens)[:, None] + jnp.minimum((t[None, :] + 1) * query_tile,
                                                           extend_lens[:, None])
    n = jnp.where(t[None, :] * query_tile < extend_lens[:, None], _cdiv(seen, block), 0)
    return n.reshape(-1), jnp.cumsum(n.reshape(-1))


def _tile_queries(q_nope, q_pe, w_kc, w_vc, bq, absorbed):
    """The queries of all heads, head-major ``[H, T + bq, .]`` (``bq`` zero rows at the end, so
    a tile never clamps), their width in the output and ``dn``: ``q[..., :dn]`` meets ``c_kv``
    (absorbed) or ``k_nope`` (decompressed).

    Head-major inside the loop ([H, rows, .]): a tile's queries of all heads are one matrix
    [H * bq, .], so the absorbed form's scores and output are plain matrix products and the
    decompressed form's batch over heads, with no per-item transposes of scores or queries."""
    H = q_nope.shape[1]
    q_pe = q_pe.astype(_F32)
    w_kc, w_vc = w_kc.astype(_F32), w_vc.astype(_F32)
    if absorbed:  # queries in latent space, once: [H, T, r] and [H, T, dr] against the latents
        q = jnp.concatenate([jnp.einsum("thd,hdr->htr", q_nope.astype(_F32), w_kc),
                             q_pe.transpose(1, 0, 2)], -1)
        width = w_kc.shape[2]
    else:
        q = jnp.concatenate([q_nope.astype(_F32), q_pe], -1).transpose(1, 0, 2)
        width = w_vc.shape[1]
    q = jnp.concatenate([q, jnp.zeros((H, bq, q.shape[2]), _F32)], 1)  # a tile never clamps
    dn = w_kc.shape[2] if absorbed else q_nope.shape[2]  # q[..., :dn] meets c_kv or k_nope
    return q, width, dn


def _scores(qt, ckv, kpe, w_kc, w_vc, dn, absorbed):
    """Step 2's unscaled scores ``[H, bq, bk]`` of a tile's queries against one key block, and
    the values they weigh (the latents themselves when absorbed); ``w_kc``, ``w_vc`` float32."""
    if absorbed:  # two products, not one against a concatenated key block (a copy)
        vals = ckv
        s = jnp.einsum("hqc,kc->hqk", qt[..., :dn], ckv) + jnp.einsum(
            "hqd,kd->hqk", qt[..., dn:], kpe)
    else:
        k_nope = jnp.einsum("kr,hdr->hkd", ckv, w_kc)
        vals = jnp.einsum("kr,hdr->hkd", ckv, w_vc)
        s = jnp.einsum("hqd,hkd->hqk", qt[..., :dn], k_nope) + jnp.einsum(
            "hqd,kd->hqk", qt[..., dn:], kpe)
    return s, vals


def _online_update(carry, s, mask, vals, live_q, row0, absorbed):
    """Step 3: the online softmax update of a tile's rows (``bq`` from ``row0``) of the running
    max, denominator and accumulator ``carry``; rows of padding queries are kept."""
    mx, den, acc = carry
    bq = s.shape[1]
    m_old = jax.lax.dynamic_slice_in_dim(mx, row0, bq, axis=1)
    d_old = jax.lax.dynamic_slice_in_dim(den, row0, bq, axis=1)
    a_old = jax.lax.dynamic_slice_in_dim(acc, row0, bq, axis=1)
    m_new = jnp.maximum(m_old, s.max(-1))
    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # no key seen yet: shift by 0
    p = jnp.where(mask, jnp.exp(s - shift[..., None]), 0.0)
    corr = jnp.exp(m_old - shift)  # 0 while m_old is -inf
    pv = (jnp.einsum("hqk,kr->hqr", p, vals) if absorbed
          else jnp.einsum("hqk,hkd->hqd", p, vals))
    keep = live_q[None, :]
    m_new = jnp.where(keep, m_new, m_old)
    d_new = jnp.where(keep, d_old * corr + p.sum(-1), d_old)
    a_new = jnp.where(keep[..., None], a_old * corr[..., None] + pv, a_old)
    return (jax.lax.dynamic_update_slice_in_dim(mx, m_new, row0, 1),
            jax.lax.dynamic_update_slice_in_dim(den, d_new, row0, 1),
            jax.lax.dynamic_update_slice_in_dim(acc, a_new, row0, 1))


@functools.partial(jax.jit, static_argnames=("max_extend_len", "scale", "block_size",
                                             "query_block", "absorbed"))
def _blockwise(q_nope, q_pe, c_kv, k_pe, w_kc, w_vc, page_table, seq_lens, extend_lens,
               query_start, *, max_extend_len, scale, block_size, query_block, absorbed,
               slot_offset=0):
    """Steps 1-4 of the module docstring; returns ``[T, H, dv]`` float32."""
    T, H, _ = q_nope.shape
    B, W = page_table.shape
    bk = min(block_size, W)
    bq = min(query_block, max_extend_len)
    nq = _cdiv(max_extend_len, bq)
    seq_lens, extend_lens = seq_lens.astype(jnp.int32), extend_lens.astype(jnp.int32)
    query_start = query_start.astype(jnp.int32)
    prefix = seq_lens - extend_lens

    n, ends = _work_list(seq_lens, extend_lens, query_tile=bq, num_tiles=nq, block=bk)
    total = ends[-1]

    q, width, dn = _tile_queries(q_nope, q_pe, w_kc, w_vc, bq, absorbed)
    w_kc, w_vc = w_kc.astype(_F32), w_vc.astype(_F32)
    m0 = jnp.full((H, T + bq), -jnp.inf, _F32)
    d0 = jnp.zeros((H, T + bq), _F32)
    acc0 = jnp.zeros((H, T + bq, width), _F32)
    i_q = jnp.arange(bq, dtype=jnp.int32)
    i_k = jnp.arange(bk, dtype=jnp.int32)

    def item(k, carry):
        mx, den, acc = carry
        # 2. Which (b, t, j) item k is, and its queries and keys.
        tile = jnp.sum(ends <= k).astype(jnp.int32)
        b, ti = tile // nq, tile % nq
        j = k - (ends[tile] - n[tile])
        row0 = query_start[b] + ti * bq
        live_q = ti * bq + i_q < extend_lens[b]  # [bq]
        qpos = prefix[b] + ti * bq + i_q
        first = j * bk
        start = jnp.minimum(first, W - bk)  # the last block may overlap the one before
        slots = jax.lax.dynamic_slice(page_table, (b, start), (1, bk))[0].astype(jnp.int32)
        slots = slots + slot_offset
        kpos = start + i_k
        live_k = (kpos >= first) & (kpos < seq_lens[b])  # [bk]
        # c_kv is zeroed where masked (it meets p in the output); k_pe only feeds scores,
        # which the mask replaces, so a stale slot there never reaches anything
        ckv = jnp.where(live_k[:, None], c_kv[slots].astype(_F32), 0.0)
        kpe = k_pe[slots].astype(_F32)
        qt = jax.lax.dynamic_slice_in_dim(q, row0, bq, axis=1)  # [H, bq, .]
        s, vals = _scores(qt, ckv, kpe, w_kc, w_vc, dn, absorbed)
        mask = (live_k[None, :] & (kpos[None, :] <= qpos[:, None]) & live_q[:, None])[None]
        s = jnp.where(mask, s * scale, -jnp.inf)  # [H, bq, bk]
        # 3. The online softmax update of the tile's rows.
        return _online_update((mx, den, acc), s, mask, vals, live_q, row0, absorbed)

    def cond(c):
        return c[0] < total

    def body(c):
        return (c[0] + 1, *item(c[0], c[1:]))

    _, _, den, acc = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), m0, d0, acc0))
    out = acc[:, :T] / jnp.maximum(den[:, :T], 1e-30)[..., None]  # no keys: 0 / tiny = 0
    if absorbed:
        return jnp.einsum("htr,hdr->thd", out, w_vc)
    return out.transpose(1, 0, 2)


def mla_extend(
    q_nope: Float[Array, "T H dn"],
    q_pe: Float[Array, "T H dr"],
    c_kv: Float[Array, "S r"],
    k_pe: Float[Array, "S dr"],
    w_kc: Float[Array, "H dn r"],
    w_vc: Float[Array, "H dv r"],
    page_table: Int[Array, "B W"],
    seq_lens: Int[Array, " B"],
    extend_lens: Int[Array, " B"],
    query_start: Int[Array, " B"],
    *,
    max_extend_len: int,
    scale: float,
    block_size: int = 512,
    query_block: int = 512,
    absorbed: bool | None = None,
    slot_offset: int | Int[Array, ""] = 0,
) -> Float[Array, "T H dv"]:
    """Causal MLA of packed ragged requests over their page-table rows, block by block: the
    inputs and result of :func:`ref_mla_extend`, with workspace ``O(T + query_block x
    block_size x H)`` and cost following each request's own length (module docstring).

    ``block_size`` keys per block, ``query_block`` queries per tile (both static; capped at
    ``W`` and ``max_extend_len``). ``absorbed`` picks the form of a block; ``None``: the
    cheaper by :func:`prefers_absorbed`, known only with the weights' shapes.

    >>> H, dn, r = 1, 2, 2
    >>> out = mla_extend(jnp.ones((2, H, dn)), jnp.ones((2, H, 1)), jnp.eye(3, r, k=-1),
    ...                  jnp.zeros((3, 1)), jnp.ones((H, dn, r)), jnp.eye(r)[None],
    ...                  jnp.array([[1, 2]]), jnp.array([2]), jnp.array([2]), jnp.array([0]),
    ...                  max_extend_len=2, scale=1.0, block_size=1)
    >>> out[:, 0].tolist()  # as ref_mla_extend's example
    [[1.0, 0.0], [0.5, 0.5]]
    """
    _check_static(block_size=block_size, query_block=query_block,
                  max_extend_len=max_extend_len)
    if absorbed is None:
        absorbed = prefers_absorbed(
            min(query_block, max_extend_len), qk_nope_head_dim=q_nope.shape[2],
            qk_rope_head_dim=q_pe.shape[2], v_head_dim=w_vc.shape[1],
            kv_lora_rank=w_kc.shape[2])
    return _blockwise(q_nope, q_pe, c_kv, k_pe, w_kc, w_vc, page_table, seq_lens, extend_lens,
                      query_start, max_extend_len=max_extend_len, scale=scale,
                      block_size=block_size, query_block=query_block, absorbed=bool(absorbed),
                      slot_offset=slot_offset)


def mla_decode(
    q_nope: Float[Array, "B H dn"],
    q_pe: Float[Array, "B H dr"],
    c_kv: Float[Array, "S r"],
    k_pe: Float[Array, "S dr"],
    w_kc: Float[Array, "H dn r"],
    w_vc: Float[Array, "H dv r"],
    page_table: Int[Array, "B W"],
    seq_lens: Int[Array, " B"],
    *,
    scale: float,
    block_size: int = 512,
    slot_offset: int | Int[Array, ""] = 0,
) -> Float[Array, "B H dv"]:
    """One query per request over its ``seq_lens[b]`` keys, block by block in absorbed form:
    :func:`ref_mla_decode`'s inputs and result, workspace ``O(B + block_size x H)``. Only a
    request's own blocks are visited; rows with ``seq_lens == 0`` cost nothing and get zeros.

    >>> out = mla_decode(jnp.ones((2, 1, 2)), jnp.ones((2, 1, 1)), jnp.eye(3, 2, k=-1),
    ...                  jnp.zeros((3, 1)), jnp.ones((1, 2, 2)), jnp.eye(2)[None],
    ...                  jnp.array([[1, 2], [0, 0]]), jnp.array([2, 0]), scale=1.0,
    ...                  block_size=1)
    >>> out[:, 0].tolist()  # row 1: a padding row
    [[0.5, 0.5], [0.0, 0.0]]
    """
    _check_static(block_size=block_size)
    B = q_nope.shape[0]
    return _blockwise(q_nope, q_pe, c_kv, k_pe, w_kc, w_vc, page_table, seq_lens,
                      (seq_lens > 0).astype(jnp.int32), jnp.arange(B, dtype=jnp.int32),
                      max_extend_len=1, scale=scale, block_size=block_size, query_block=1,
                      absorbed=True, slot_offset=slot_offset)


def _check_static(**sizes):
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
