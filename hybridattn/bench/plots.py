"""Plots of the benchmarks' results: ``python -m hybridattn.bench WHAT ... --plot DIR``.

Each function takes the dict a benchmark returns (the one ``--json`` prints, so a saved run
plots again with ``--from-json FILE``) and writes one PNG into ``DIR``, named after the
benchmark (``kda.png``, ``serve.png``, ``prefix.png``, ``longctx.png``); it returns the path.
matplotlib draws off screen (the Agg backend), small enough to commit (about 30 KB a plot).
"""

from __future__ import annotations

import os

_STYLE = dict(figsize=(7.0, 3.4), dpi=90)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out_dir: str, name: str, tight: bool = True) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.png")
    if tight:
        fig.tight_layout()
    fig.savefig(path)
    fig.clf()
    return path


def plot_kda(res: dict, out_dir: str) -> str:
    """Prefill tokens/s against ``T`` for every KDA kernel of a ``bench kda`` result (left)
    and the chunked form's share of the matmul peak (right)."""
    plt = _pyplot()
    fig, (tok, peak) = plt.subplots(1, 2, **{**_STYLE, "figsize": (7.0, 3.9)})
    rows = res["prefill"]
    Ts = [r["T"] for r in rows]
    chunk_sizes = [str(c) for c in res["shape"]["chunk_sizes"]]
    split = "split" in rows[0]  # heads split over CPU devices: dashed, in the same colour
    n = res["shape"].get("devices", 1)
    for j, C in enumerate(chunk_sizes):
        c = f"C{j}"
        tok.plot(Ts, [r["chunked"][C]["tok_s"] for r in rows], "o-", color=c,
                 label=f"chunked C={C}")
        peak.plot(Ts, [100 * r["chunked"][C]["peak_fraction"] for r in rows], "o-", color=c,
                  label=f"chunked C={C}")
        if split:
            tok.plot(Ts, [r["split"][C]["tok_s"] for r in rows], "o--", color=c,
                     label=f"chunked C={C}, heads /{n}")
            peak.plot(Ts, [100 * r["split"][C]["peak_fraction"] for r in rows], "o--",
                      color=c, label=f"chunked C={C}, heads /{n}")
    tok.plot(Ts, [r["recurrent_tok_s"] for r in rows], "s-", color="gray", label="recurrent")
    if split:
        tok.plot(Ts, [r["split_recurrent_tok_s"] for r in rows], "s--", color="gray",
                 label=f"recurrent, heads /{n}")
    mlx = [(r["T"], r["mlx_ops_tok_s"]) for r in rows if "mlx_ops_tok_s" in r]
    if mlx:
        tok.plot(*zip(*mlx, strict=True), "^-", color="black", label="mlx-lm ops")
    tok.set(xscale="log", yscale="log", xlabel="T (tokens)", ylabel="prefill tok/s",
            title=f"KDA prefill, H={res['shape']['H']}, D={res['shape']['Dk']}")
    peak.set(xscale="log", xlabel="T (tokens)", ylabel="% of f32 matmul peak",
             title="chunked form vs matmul peak")
    peak.set_ylim(bottom=0)
    for ax in (tok, peak):
        ax.set_xticks(Ts, [f"{t:,}" for t in Ts])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    fig.legend(*tok.get_legend_handles_labels(), fontsize=7, ncol=4, loc="lower center")
    fig.tight_layout(rect=(0, 0.13, 1, 1))  # the legend below both plots
    return _save(fig, out_dir, "kda", tight=False)


def plot_serve(res: dict, out_dir: str) -> str:
    """Prefill and decode tokens/s against the batch size for our engine and the anchors of
    a ``bench serve`` result."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, **_STYLE)
    rows = res["rows"]
    B = [r["batch_size"] for r in rows]
    names = {"ours": "hybridattn.Engine", "ours_sync": "hybridattn.Engine, overlap=False",
             "mlx_lm": "mlx-lm", "transformers": "transformers"}
    for ax, what in zip(axes, ("prefill", "decode"), strict=True):
        for key, label in names.items():
            pts = [(r["batch_size"], r[key][f"{what}_tok_s"]) for r in rows
                   if isinstance(r.get(key), dict) and f"{what}_tok_s" in r[key]]
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", label=label)
        if what == "decode":  # the hardware bound: bytes one step reads over the bandwidth
            ax.plot(B, [r["batch_size"] / r["decode_floor_s"] for r in rows], "k:",
                    label="bandwidth floor")
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel=f"{what} tok/s",
               title=f"{what}, prompts of {res['prompt_len']} tokens")
        ax.set_xticks(B, [str(b) for b in B])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, out_dir, "serve")


def plot_prefix(res: dict, out_dir: str) -> str:
    """Time to first token with and without the prefix cache (left), and the prefill
    speedup beside its two ideals (right), per workload of a ``bench prefix`` result."""
    plt = _pyplot()
    fig, (ttft, speed) = plt.subplots(1, 2, **_STYLE)
    names = {"a": "(a) shared prefix", "b": "(b) conversations"}
    work = res["workloads"]
    keys = list(work)
    x = range(len(keys))
    labels = [names.get(k, k) for k in keys]
    w = 0.38
    ttft.bar([i - w / 2 for i in x], [work[k]["without_cache"]["ttft_s"] * 1e3 for k in keys],
             w, label="without cache")
    ttft.bar([i + w / 2 for i in x], [work[k]["with_cache"]["ttft_s"] * 1e3 for k in keys],
             w, label="with cache")
    ttft.set(ylabel="mean TTFT (ms)", title="time to first token")
    w = 0.27
    for j, (field, label) in enumerate((("speedup", "measured"),
                                        ("measured_ideal", "measured ideal"),
                                        ("token_ratio_ideal", "token-ratio ideal"))):
        speed.bar([i + (j - 1) * w for i in x], [work[k][field] for k in keys], w, label=label)
    speed.set(ylabel="prefill speedup (x)", title="speedup from the cache")
    for ax in (ttft, speed):
        ax.set_xticks(list(x), labels)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    return _save(fig, out_dir, "prefix")


def plot_longctx(res: dict, out_dir: str) -> str:
    """Prefill tokens/s (left), peak memory beside the pools and parameters (middle) and
    decode ms per step beside the bandwidth floor (right) against the prompt length, for
    the lengths of a ``bench longctx`` result that completed."""
    plt = _pyplot()
    fig, (tok, mem, dec) = plt.subplots(1, 3, **{**_STYLE, "figsize": (10.5, 3.4)})
    rows = [r for r in res["rows"] if "failed" not in r]
    n = [r["prompt_len"] for r in rows]
    tok.plot(n, [r["prefill_tok_s"] for r in rows], "o-")
    tok.set(title="prefill tok/s", xlabel="prompt tokens")
    mem.plot(n, [r["peak_prefill_rss_bytes"] / 1e6 for r in rows], "o-", label="peak RSS")
    mem.plot(n, [(r["pool_bytes"] + r["param_bytes"]) / 1e6 for r in rows], "s--",
             label="pools + params")
    mem.axhline(res["targets"]["prefill_peak_bytes"] / 1e6, color="grey", ls=":",
                label="64k target")
    mem.set(title="memory (MB)", xlabel="prompt tokens")
    dec.plot(n, [1e3 * (r["decode_step_s"] or 0) for r in rows], "o-", label="decode step")
    dec.plot(n, [1e3 * r["decode_floor_s"] for r in rows], "s--", label="bandwidth floor")
    dec.set(title="decode ms/step", xlabel="prompt tokens")
    for ax in (tok, mem, dec):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    for ax in (mem, dec):
        ax.legend(fontsize=7)
    return _save(fig, out_dir, "longctx")


PLOTS = {"kda": plot_kda, "serve": plot_serve, "prefix": plot_prefix, "longctx": plot_longctx}
"""The plot of each benchmark, by its subcommand's name."""
