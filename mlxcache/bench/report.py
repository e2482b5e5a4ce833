"""The benchmarks' results as text tables: ``format_table`` (``python -m mlxcache.bench``)
and ``format_server_table`` (``python -m mlxcache.bench server``)."""

from __future__ import annotations

TITLES = {
    "shared_prefix": "(a) shared prefix",
    "branching": "(b) branching",
    "multi_turn": "(m) multi-turn",
}


def format_table(r: dict) -> str:
    lines = []
    for m in r["models"].values():
        snaps = (f"; {m['num_snapshots']} snapshot slots x {m['snapshot_bytes']} B"
                 if m["num_snapshots"] else "")
        lines.append(f"model: {m['model']}; caches {', '.join(m['caches'])}{snaps}")
        for key, title in TITLES.items():
            if key not in m:
                continue
            t = m[key]
            measured = (f", measured ideal {t['measured_ideal']:.2f}x"
                        if "measured_ideal" in t else "")
            lines.append(
                f"{title}: {t['prompt_tokens']} prompt tokens, {t['uncached_tokens']} uncached, "
                f"ideal speedup {t['ideal_speedup']:.2f}x{measured}; same tokens as no reuse: "
                f"{'yes' if t['same_tokens'] else 'NO'}"
                + ("" if t["lru_trims"] else "; mlx-lm cannot trim these caches")
            )
            lines.append(
                f"  {'system':<26}{'prefill tok/s':>14}{'mean TTFT ms':>14}{'speedup':>9}"
                f"{'of ideal':>10}{'of measured':>13}"
            )
            for s in t["systems"]:
                of_measured = (f"{s['of_measured_ideal']:>12.0%}" if "of_measured_ideal" in s
                               else f"{'-':>12}")
                lines.append(
                    f"  {s['system']:<26}{s['tokens_per_s']:>14.0f}{s['ttft_s'] * 1e3:>14.1f}"
                    f"{s['speedup']:>8.2f}x{s['of_ideal']:>9.0%} {of_measured}"
                )
            hits = []
            for s in t["systems"]:
                st = s.get("stats")
                if st and s["system"] != "no reuse":
                    hit = f"{s['system']} {st['cached_tokens'] / st['prompt_tokens']:.0%}"
                    if "snapshots_taken" in st and m["num_snapshots"]:
                        hit += (f" ({st['snapshots_taken']} snapshots taken, "
                                f"{st['state_evictions']} evicted)")
                    hits.append(hit)
            lines.append(f"  tokens reused: {', '.join(hits)}")
    lines.append("(c) batched decode tokens/s")
    lines.append(f"  {'model':<12}{'B':>4}{'mlxcache':>12}{'BatchGenerator':>16}{'ratio':>8}")
    for name, rows in r["decode"].items():
        for d in rows:
            lines.append(
                f"  {name:<12}{d['batch']:>4}{d['mlxcache_tok_s']:>12.0f}"
                f"{d['batch_generator_tok_s']:>16.0f}{d['ratio']:>7.2f}x"
            )
    lines.append("(d) one set_kv, 16 tokens, one layer")
    lines.append(f"  {'pool slots':>10}{'linear us':>12}{'old pool held us':>18}")
    for s in r["set_kv"]:
        lines.append(f"  {s['slots']:>10}{s['linear_us']:>12.1f}{s['held_us']:>18.1f}")
    return "\n".join(lines)


_SERVER_ROWS = (  # (label, key, scale, format)
    ("wall s", "wall_s", 1.0, "{:.3f}"),
    ("mean TTFT ms", "ttft_mean_s", 1e3, "{:.1f}"),
    ("p90 TTFT ms", "ttft_p90_s", 1e3, "{:.1f}"),
    ("decode ms/token", "decode_s_per_token", 1e3, "{:.2f}"),
    ("prompt tokens", "prompt_tokens", 1, "{:,.0f}"),
    ("prompt tokens computed", "computed_tokens", 1, "{:,.0f}"),
)


def _server_cell(figures: dict, key: str, scale: float, fmt: str) -> str:
    if "error" in figures:
        return "error"
    value = figures[key]
    if value is None:
        return "n/a"
    return fmt.format(value * scale)


def format_server_table(r: dict) -> str:
    """``python -m mlxcache.bench server``'s result: per model and workload, each server's
    figures side by side, the ratio ours / anchor, whether the greedy answers agree."""
    ours, anchor = r["servers"]
    lines = [f"server benchmark{' (--quick)' if r['quick'] else ''}: {ours} vs {anchor}, "
             f"medians of {r['repeats']} round{'s' * (r['repeats'] != 1)}; "
             f"ratio = {ours} / {anchor}"]
    for family, m in r["models"].items():
        lines.append(f"model: {family} ({', '.join(m['caches'])})")
        for w in m["workloads"].values():
            lines.append(f"{w['title']}: {w['requests']} requests")
            lines.append(f"  {'':<24}{ours:>16}{anchor:>16}{'ratio':>9}")
            for label, key, scale, fmt in _SERVER_ROWS:
                cells = [_server_cell(w["servers"][s], key, scale, fmt) for s in (ours, anchor)]
                ratio = w.get("ratios", {}).get(key)
                lines.append(f"  {label:<24}{cells[0]:>16}{cells[1]:>16}"
                             + (f"{ratio:>8.2f}x" if ratio is not None else ""))
            if w.get("wall_ratios") and len(w["wall_ratios"]) > 1:
                lo, hi = min(w["wall_ratios"]), max(w["wall_ratios"])
                lines.append(f"  {'wall ratio, rounds':<24}{'':>31}{lo:>5.2f}-{hi:.2f}x")
            if "agree" in w:
                agree = f"{w['agree']}/{w['total']}"
                lines.append(f"  {'greedy answers agree':<24}{agree:>16}")
            for s in (ours, anchor):
                if "error" in w["servers"][s]:
                    lines.append(f"  {s} error: {w['servers'][s]['error']}")
    return "\n".join(lines)
