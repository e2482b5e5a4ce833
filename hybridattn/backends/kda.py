"""KDA: linear attention over the recurrent-state pool (:class:`KDAAttnBackend`).
"""

from __future__ import annotations

from typing import no_type_check

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from hybridattn.backends.base import (
    ForwardBatch,
    ForwardMode,
    LinearAttnMetadata,
    _layer_id,
    _pool_key,
    _query_start,
    check_forward_batch,
)
from hybridattn.config import KimiLinearConfig
from hybridattn.ops.conv import short_conv
from hybridattn.ops.kda import kda_chunked, kda_decode, l2norm, recurrent_steps
from hybridattn.pools import (
    get_linear_recurrent_indices,
    get_states,
    set_states,
)
from hybridattn.pytree import pytree_dataclass

__all__ = [
    "KDAAttnBackend",
]

# --------------------------------------------------------------------------------------------
# KDA: linear attention over the recurrent-state pool
# --------------------------------------------------------------------------------------------


@pytree_dataclass(
    static=("layer_ids", "num_heads", "head_k_dim", "head_v_dim", "conv_kernel",
            "num_state_slots", "chunk_size")
)
class KDAAttnBackend:
    """Kimi Delta Attention over :class:`RecurrentStatePool`.

    Layer inputs (``T`` tokens): the projections ``q, k [T, Hk*Dk]``, ``v [T, Hk*Dv]`` before
    the short convolution, the conv weights ``q_conv, k_conv, v_conv`` (``[C, 1, K]`` or
    ``[C, K]``), the log-decay ``g [T, Hk, Dk]`` (:func:`hybridattn.ops.kda_gate`) and
    ``beta [T, Hk]``. The backend runs the short conv (carrying each request's conv state), the
    q/k L2 norm and the recurrence (:func:`kda_chunked` over the packed requests on extend,
    :func:`kda_decode` on decode), reading a request's state from the pool when it has a cached
    prefix and writing every request's final state back. Output ``[T, Hk, Dv]``.

    >>> kda = KDAAttnBackend.from_config(KimiLinearConfig.tiny(), num_state_slots=9)
    >>> kda.layer_ids, kda.num_heads, kda.head_k_dim, kda.conv_kernel, kda.chunk_size
    ((0, 1, 2), 4, 16, 4, 32)
    >>> kda.get_max_running_requests(max_context_len=1_000_000)  # one state slot a request
    8
    """

    layer_ids: tuple[int, ...]
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    num_state_slots: int
    chunk_size: int = 32
    forward_metadata: LinearAttnMetadata | None = None

    @classmethod
    def from_config(
        cls, config: KimiLinearConfig, num_state_slots: int, chunk_size: int = 32
    ) -> KDAAttnBackend:
        """The backend for ``config``'s KDA layers over ``num_state_slots`` state slots (the
        sink included); ``chunk_size`` is the :func:`kda_chunked` chunk on extend."""
        return cls(
            layer_ids=tuple(config.kda_layer_ids),
            num_heads=config.linear_num_heads,
            head_k_dim=config.linear_head_dim,
            head_v_dim=config.linear_head_dim,
            conv_kernel=config.linear_conv_kernel_dim,
            num_state_slots=num_state_slots,
            chunk_size=chunk_size,
        )

    def get_forward_metadata(self, batch: ForwardBatch) -> LinearAttnMetadata:
        """This backend's metadata for ``batch`` (validated by :func:`check_forward_batch`)."""
        check_forward_batch(batch)
        if batch.recurrent_state_pool.num_slots != self.num_state_slots:
            raise ValueError(f"KDAAttnBackend has num_state_slots={self.num_state_slots} but "
                             f"the recurrent-state pool has "
                             f"{batch.recurrent_state_pool.num_slots} slots")
        T = batch.num_tokens
        qs = _query_start(batch.extend_seq_lens)
        snaps = {}
        spec = batch.snapshot_spec
        if spec is not None and spec.num_snapshots:
            b = spec.batch_index.astype(jnp.int32)
            used = spec.slots > 0
            snaps = dict(
                snapshot_windowed=(spec.num_snapshots if spec.windowed is None
                                   else min(spec.windowed, spec.num_snapshots)),
                snapshot_seqs=jnp.where(used, b, 0),
                snapshot_offsets=jnp.where(used, spec.lens - batch.prefix_lens[b], 0).astype(
                    jnp.int32),
                snapshot_slots=jnp.where(used, spec.slots, 0).astype(jnp.int32),
            )
        return LinearAttnMetadata(
            cu_seqlens=jnp.concatenate([qs, jnp.full((1,), T, jnp.int32)]),
            state_indices=get_linear_recurrent_indices(
                batch.req_to_token_pool, batch.req_pool_indices
            ).astype(jnp.int32),
            has_initial_state=batch.prefix_lens > 0,
            **snaps,
        )

    def with_forward_metadata(self, md: LinearAttnMetadata) -> KDAAttnBackend:
        """A copy bound to ``md``, ready to run the layers of one forward."""
        return self.replace(forward_metadata=md)

    def get_max_running_requests(self, max_context_len: int, page_size: int = 1) -> int:
        """``num_state_slots - 1``: a request's state has the same size at any length."""
        del max_context_len, page_size  # the state is the same size at any context length
        return self.num_state_slots - 1

    def _md(self) -> LinearAttnMetadata:
        if self.forward_metadata is None:
            raise ValueError("KDAAttnBackend has no forward metadata: call with_forward_metadata")
        return self.forward_metadata

    def _prepare(self, layer, T, q, k, v, g, beta, q_conv, k_conv, v_conv):
        layer_id = _layer_id(layer)
        if layer_id not in self.layer_ids:
            raise ValueError(f"layer {layer_id} is not a KDA layer (KDA layers: {self.layer_ids})")
        H, Dk, Dv = self.num_heads, self.head_k_dim, self.head_v_dim
        want = dict(q=(T, H * Dk), k=(T, H * Dk), v=(T, H * Dv), g=(T, H, Dk), beta=(T, H))
        got = dict(q=q, k=k, v=v, g=g, beta=beta)
        for name, shape in want.items():
            if got[name].shape != shape:
                raise ValueError(f"KDA layer {layer_id}: {name} has shape {got[name].shape}, "
                                 f"expected {shape}")
        convs = dict(q_conv=(q_conv, H * Dk), k_conv=(k_conv, H * Dk), v_conv=(v_conv, H * Dv))
        for name, (w, channels) in convs.items():
            if _conv2d(w).shape != (channels, self.conv_kernel):
                raise ValueError(f"KDA layer {layer_id}: {name} has shape {w.shape}, expected "
                                 f"{(channels, 1, self.conv_kernel)} or "
                                 f"{(channels, self.conv_kernel)}")
        weight = jnp.concatenate([_conv2d(w) for w, _ in convs.values()], axis=0)
        return _pool_key(layer), weight, jnp.concatenate([q, k, v], axis=-1)

    def _split_heads(self, y, T):
        H, Dk, Dv = self.num_heads, self.head_k_dim, self.head_v_dim
        qc, kc, vc = jnp.split(y, [H * Dk, 2 * H * Dk], axis=-1)
        q = l2norm(qc.reshape(T, H, Dk).astype(jnp.float32))
        k = l2norm(kc.reshape(T, H, Dk).astype(jnp.float32))
        return q, k, vc.reshape(T, H, Dv)

    @no_type_check
    def forward_extend(
        self,
        layer,
        batch: ForwardBatch,
        *,
        q: Float[Array, "T HkDk"],
        k: Float[Array, "T HkDk"],
        v: Float[Array, "T HkDv"],
        g: Float[Array, "T Hk Dk"],
        beta: Float[Array, "T Hk"],
        q_conv: Float[Array, "HkDk 1 K"] | Float[Array, "HkDk K"],
        k_conv: Float[Array, "HkDk 1 K"] | Float[Array, "HkDk K"],
        v_conv: Float[Array, "HkDv 1 K"] | Float[Array, "HkDv K"],
    ) -> tuple[Float[Array, "T Hk Dv"], ForwardBatch]:
        """Run the packed requests (short conv, L2 norm, :func:`kda_chunked`), starting from
        their pooled states where they have a cached prefix: ``(out, batch)``. On a CPU a
        batch whose requests extend by at most ``RECURRENT_MAX_EXTEND`` tokens and that takes
        no snapshot runs the recurrence of :func:`kda_recurrent` over the requests side by
        side instead (``_packed_recurrent``): faster there at these lengths, and a much
        smaller program."""
        md = self._md()
        T = q.shape[0]
        layer_id, weight, mixed = self._prepare(layer, T, q, k, v, g, beta, q_conv, k_conv, v_conv)
        pool = batch.recurrent_state_pool
        idx = jnp.concatenate([md.state_indices, jnp.zeros((1,), jnp.int32)])  # + padding seq
        has = jnp.concatenate([md.has_initial_state, jnp.zeros((1,), bool)])
        conv0, ssm0 = _initial_states(pool, layer_id, idx, has, mixed.dtype)
        y, conv1 = short_conv(mixed[None], weight, conv0, cu_seqlens=md.cu_seqlens)
        qh, kh, vh = self._split_heads(y[0], T)
        snapshots = md.snapshot_slots is not None
        if (not snapshots and batch.max_extend_len <= RECURRENT_MAX_EXTEND
                and jax.default_backend() == "cpu"):
            o, ssm1 = _packed_recurrent(qh, kh, vh, g, beta, ssm0, md.cu_seqlens,
                                        batch.max_extend_len)
        else:
            o, ssm1, *cs = kda_chunked(
                qh[None], kh[None], vh[None], g[None], beta[None], initial_state=ssm0,
                chunk_size=self.chunk_size, cu_seqlens=md.cu_seqlens,
                return_chunk_states=snapshots,
            )
            o = o[0]
        pool = set_states(pool, layer_id, idx, conv1, ssm1)
        if snapshots:
            conv_s, ssm_s = self._snapshot_states(md, cs[0], mixed, conv0, ssm0, ssm1,
                                                  (qh, kh, vh, g, beta))
            snap_pool = set_states(batch.snapshot_pool, layer_id, md.snapshot_slots, conv_s,
                                   ssm_s)
            batch = batch.replace(snapshot_pool=snap_pool)
        return o.astype(v.dtype), batch.replace(recurrent_state_pool=pool)

    def _snapshot_states(self, md, cs, mixed, conv0, ssm0, ssm1, inputs):
        """Conv and recurrent states of each snapshot: request ``b`` after ``off`` tokens of
        this extend. The recurrent state is exact where it is a chunk state of
        ``kda_chunked`` (``off`` a multiple of the chunk) or the final state (``off`` = the
        whole extend); in between it continues from the chunk state at or before ``off`` over
        the remaining ``< C`` tokens with one more ``kda_chunked`` chunk (the same math in
        another order: equal to rounding). The conv state is the last ``K - 1`` inputs before
        ``off``, read from the layer's inputs or the initial conv state."""
        b, off = md.snapshot_seqs, md.snapshot_offsets
        C, K, T = self.chunk_size, self.conv_kernel, mixed.shape[0]
        start = md.cu_seqlens[b]
        ext = md.cu_seqlens[b + 1] - start
        c = (off // C) * C  # the chunk boundary at or before each snapshot
        match = (cs.seq_ids[0][None, :] == b[:, None]) & (cs.num_tokens[0][None, :] == c[:, None])
        at_c = jnp.where((match.any(1) & (c > 0))[:, None, None, None],
                         cs.states[0][jnp.argmax(match, axis=1)], ssm0[b])
        Mw = md.snapshot_windowed  # only these entries may lie between chunk boundaries
        if Mw:
            i = jnp.arange(C, dtype=jnp.int32)
            rest = (off - c)[:Mw]
            valid = i[None, :] < rest[:, None]  # [Mw, C]: the tokens after the boundary
            tok = jnp.clip(start[:Mw, None] + c[:Mw, None] + i[None, :], 0, T - 1)

            def window(x):  # [T, ...] -> [Mw, C, ...], neutral (zero) where not valid
                w = x[tok]
                return jnp.where(valid.reshape(valid.shape + (1,) * (w.ndim - 2)), w, 0)

            qw, kw, vw, gw, bw = (window(x.astype(jnp.float32)) for x in inputs)
            _, cont = kda_chunked(qw, kw, vw, gw, bw, initial_state=at_c[:Mw], chunk_size=C)
            at_c = at_c.at[:Mw].set(jnp.where((rest == 0)[:, None, None, None], at_c[:Mw],
                                              cont))
        ssm = jnp.where((off == ext)[:, None, None, None], ssm1[b], at_c)
        pos = off[:, None] - (K - 1) + jnp.arange(K - 1, dtype=jnp.int32)[None, :]  # [M, K-1]
        from_x = mixed[jnp.clip(start[:, None] + pos, 0, T - 1)]
        from_state = conv0[b[:, None], jnp.clip(K - 1 + pos, 0, K - 2)]
        conv = jnp.where((pos >= 0)[..., None], from_x, from_state.astype(mixed.dtype))
        return conv, ssm

    @no_type_check
    def forward_decode(
        self,
        layer,
        batch: ForwardBatch,
        *,
        q: Float[Array, "B HkDk"],
        k: Float[Array, "B HkDk"],
        v: Float[Array, "B HkDv"],
        g: Float[Array, "B Hk Dk"],
        beta: Float[Array, "B Hk"],
        q_conv: Float[Array, "HkDk 1 K"] | Float[Array, "HkDk K"],
        k_conv: Float[Array, "HkDk 1 K"] | Float[Array, "HkDk K"],
        v_conv: Float[Array, "HkDv 1 K"] | Float[Array, "HkDv K"],
    ) -> tuple[Float[Array, "B Hk Dv"], ForwardBatch]:
        """One new token per request (``T == B``) through :func:`kda_decode`:
        ``(out, batch)``."""
        md = self._md()
        B = q.shape[0]
        layer_id, weight, mixed = self._prepare(layer, B, q, k, v, g, beta, q_conv, k_conv, v_conv)
        pool = batch.recurrent_state_pool
        conv0, ssm0 = _initial_states(pool, layer_id, md.state_indices, md.has_initial_state,
                                      mixed.dtype)
        y, conv1 = short_conv(mixed[:, None], weight, conv0)  # [B, 1, Cc]
        qh, kh, vh = self._split_heads(y[:, 0], B)
        o, ssm1 = kda_decode(qh, kh, vh, g, beta, ssm0)
        pool = set_states(pool, layer_id, md.state_indices, conv1, ssm1)
        return o.astype(v.dtype), batch.replace(recurrent_state_pool=pool)

    def __call__(self, layer, batch: ForwardBatch, **inputs):
        """``out, batch = backend(layer, batch, **inputs)``: dispatch on the batch's mode."""
        if batch.forward_mode == ForwardMode.DECODE:
            return self.forward_decode(layer, batch, **inputs)
        return self.forward_extend(layer, batch, **inputs)


RECURRENT_MAX_EXTEND = 64
"""The longest extend (``ForwardBatch.max_extend_len``) that ``KDAAttnBackend`` runs with
:func:`kda_recurrent` on a CPU (when the batch takes no snapshot). Measured on a 2-core CPU at
4 heads of 64 (one request, ``kda_recurrent`` against ``kda_chunked``, its chunk 64): 16
tokens 0.19 against 0.81 ms, 64 tokens 0.66 against 0.92 ms, 8 requests of 64 tokens 11.9
against 17.5 ms; at 4 requests of 256 tokens the two are level (``kda_recurrent`` over the
whole bucket; the extend stops after its longest request). Compiling the recurrence is about
a fifth of the chunked form's (0.34 against 1.75 s for one call)."""


def _packed_recurrent(q, k, v, g, beta, initial_state, cu_seqlens, max_len: int):
    """:func:`kda_recurrent` over packed requests: ``(o [T, H, Dv], final [N, H, Dk, Dv])``
    for the ``N`` sequences of ``cu_seqlens`` (``[N + 1]``, the last one the batch's padding),
    each of the first ``N - 1`` at most ``max_len`` tokens. Their tokens are laid side by side
    as ``[N - 1, max_len]`` with neutral tokens after each request's end (``k = v = 0``, ``g =
    0``, ``beta = 0``: the state passes unchanged), so every request's output and final state
    are those of the recurrence over its own tokens; the loop stops after the longest request
    (a 24-token prompt in the 64-token bucket runs 24 steps). The padding sequence is not run:
    its tokens' outputs are 0 and its final state is its initial one (the sink slot's)."""
    T = q.shape[0]
    start, lens = cu_seqlens[:-2], cu_seqlens[1:-1] - cu_seqlens[:-2]
    i = jnp.arange(max_len, dtype=jnp.int32)
    live = i[None, :] < lens[:, None]  # [R, max_len]
    tok = jnp.where(live, start[:, None] + i[None, :], T)  # T: a neutral token (dropped)

    def side_by_side(x):  # [T, ...] -> [max_len, R, ...] (time-major), zero past each end
        x = jnp.concatenate([x.astype(jnp.float32), jnp.zeros((1,) + x.shape[1:], jnp.float32)])
        return x[tok.T]

    o, final = recurrent_steps(*(side_by_side(x) for x in (q, k, v, g, beta)),
                                initial_state[:-1], jnp.max(lens))
    out = jnp.zeros((T + 1,) + o.shape[2:], v.dtype).at[tok].set(
        jnp.swapaxes(o, 0, 1).astype(v.dtype))[:T]
    return out, jnp.concatenate([final, initial_state[-1:]])


def _initial_states(pool, layer_id, idx, has, dtype):
    """Conv and recurrent states of slots ``idx``; zeros where ``has`` is false (a request
    without a cached prefix starts from zero, whatever its slot held before)."""
    conv, ssm = get_states(pool, layer_id, idx)
    conv = jnp.where(has[:, None, None], conv, 0).astype(dtype)
    return conv, jnp.where(has[:, None, None, None], ssm, 0.0)


def _conv2d(w):
    """Conv weight as ``[C, K]`` (accepts the checkpoint's ``[C, 1, K]``)."""
    return w[:, 0, :] if w.ndim == 3 else w
