"""``make demo``: a short KDA demo (until the serving engine lands).

Builds one KDA layer's worth of inputs with Kimi-Linear's conventions (short conv, l2-normalised
q/k, the per-channel gate), runs a long prefill through :func:`hybridattn.ops.kda_chunked`,
checks it against the step-by-step reference, then decodes a few tokens for a batch of
requests with :func:`hybridattn.ops.kda_decode`, and prints what it computed and how fast.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from hybridattn import ops


def _timed(fn, *args, repeats=1):
    """``(output, best wall time over repeats)``."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return out, best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybridattn.demo", description=__doc__)
    p.add_argument("--tokens", type=int, default=2048, help="prefill length")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="requests in the decode batch")
    args = p.parse_args(argv)
    T, H, D, hidden = args.tokens, args.heads, args.head_dim, args.hidden
    HD = H * D
    print(f"KDA demo: one Kimi-Linear KDA layer, hidden={hidden}, H={H}, Dk=Dv={D}, "
          f"prefill T={T}, decode batch={args.batch}   [{jax.default_backend()}]")

    ks = jax.random.split(jax.random.key(0), 10)
    init = lambda key, shape, fan_in: jax.random.normal(key, shape) * fan_in**-0.5
    params = dict(
        w_qkv=init(ks[0], (hidden, 3 * HD), hidden),
        conv=init(ks[1], (3 * HD, 4), 4),
        w_fa=init(ks[2], (hidden, D), hidden),
        w_fb=init(ks[3], (D, HD), D),
        w_b=init(ks[4], (hidden, H), hidden),
        A_log=jnp.log(jnp.linspace(1.0, 16.0, H)),
        dt_bias=jnp.zeros(HD),
    )

    def layer_inputs(params, x, conv_state):
        """Projections, short conv, l2norm and gates for ``x [B, T, hidden]``."""
        B, T_, _ = x.shape
        qkv, conv_state = ops.short_conv(x @ params["w_qkv"], params["conv"], conv_state)
        q, k, v = (t.reshape(B, T_, H, D) for t in jnp.split(qkv, 3, axis=-1))
        g = ops.kda_gate((x @ params["w_fa"] @ params["w_fb"]).reshape(B, T_, H, D),
                         params["A_log"], params["dt_bias"])
        beta = jax.nn.sigmoid(x @ params["w_b"])
        return ops.l2norm(q), ops.l2norm(k), v, g, beta, conv_state

    @jax.jit
    def prefill(params, x):
        q, k, v, g, beta, conv_state = layer_inputs(params, x, None)
        o, state = ops.kda_chunked(q, k, v, g, beta)
        return o, state, conv_state

    @jax.jit
    def prefill_reference(params, x):
        q, k, v, g, beta, _ = layer_inputs(params, x, None)
        return ops.kda_recurrent(q, k, v, g, beta)

    @jax.jit
    def decode(params, x, state, conv_state):
        q, k, v, g, beta, conv_state = layer_inputs(params, x, conv_state)
        o, state = ops.kda_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
        return o, state, conv_state

    x = jax.random.normal(ks[5], (1, T, hidden))
    _, t_compile = _timed(prefill, params, x)
    _timed(prefill_reference, params, x)  # compile
    (o, state, conv_state), t_c = _timed(prefill, params, x, repeats=5)
    (o_ref, state_ref), t_r = _timed(prefill_reference, params, x, repeats=5)
    err = float(jnp.max(jnp.abs(o - o_ref)))
    s_err = float(jnp.max(jnp.abs(state - state_ref)))
    print(f"  prefill  kda_chunked   {T / t_c:10.0f} tok/s  ({t_c * 1e3:7.1f} ms best of 5, "
          f"compile+first run {t_compile:.2f} s)")
    print(f"  prefill  kda_recurrent {T / t_r:10.0f} tok/s  ({t_r * 1e3:7.1f} ms)   "
          f"chunked is {t_r / t_c:.1f}x faster")
    print(f"  chunked vs reference: max |o| diff {err:.2e}, max |state| diff {s_err:.2e}")
    g_all = layer_inputs(params, x, None)[3]
    print(f"  gates: per-token log-decay in [{float(g_all.min()):.1f}, "
          f"{float(g_all.max()):.3f}], state norm {float(jnp.linalg.norm(state)):.2f}")

    # Decode: the prefilled request plus (batch - 1) others, one token each step.
    B = args.batch
    state_b = jnp.concatenate([state, jnp.zeros((B - 1, H, D, D))])
    conv_b = jnp.concatenate([conv_state, jnp.zeros((B - 1,) + conv_state.shape[1:])])
    xs = jax.random.normal(ks[6], (16, B, 1, hidden))
    jax.block_until_ready(decode(params, xs[0], state_b, conv_b))
    t0 = time.perf_counter()
    for t in range(16):
        o_t, state_b, conv_b = decode(params, xs[t], state_b, conv_b)
    jax.block_until_ready(o_t)
    dt = (time.perf_counter() - t0) / 16
    print(f"  decode   kda_decode    {B / dt:10.0f} tok/s  ({dt * 1e3:7.3f} ms/step for "
          f"{B} requests); state per request {H * D * D * 4 / 1024:.0f} KiB, fixed in T")

    ok = err < 1e-3 and s_err < 1e-3 and np.isfinite(np.asarray(o_t)).all()
    print("  check: " + ("OK" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
