"""``python -m mlxcache.bench server [--quick] [--json PATH] [--repeats N] [--families ...]``:
the same chat workloads sent through the ``openai`` client to ``python -m mlxcache.serve``
and to mlx-lm's own ``mlx_lm.server`` (the anchor), each a real subprocess on 127.0.0.1.

For each family (``llama``: ``KVCache``; ``qwen3_next``: hybrid, gated-delta ``ArraysCache``
layers and a full-attention layer; ``gemma3_text``: a sliding window of ``zoo.SLIDING_WINDOW``
tokens and a global layer) ``zoo.save_checkpoint`` writes the tiny random model and the word
tokenizer into a temporary directory; both servers load it and answer one warm-up request
each, then ``--repeats`` rounds (7; 1 with ``--quick``) run every workload of
``chat_workloads``, with fresh words each round, on one server and then the other (the order
alternates from round to round, so a busy spell on a shared machine slows both alike; each
server keeps its own prompt cache; no two workloads or rounds share a prompt). Every request
is a streamed chat completion at temperature 0 with ``stream_options.include_usage``. Per
workload and server, medians over the rounds: the total wall time, mean and p90 TTFT (send
to first content chunk), the mean time per output token after the first, the prompt tokens,
and the prompt tokens computed (``usage.prompt_tokens`` minus
``usage.prompt_tokens_details.cached_tokens``, summed; "n/a" where a server reports no cached
count); over all rounds, how many greedy answers equal the other server's. Ratios are ours /
anchor (below 1 is better): times as medians of the per-round ratios (paired), computed
tokens as the ratio of the medians. A server that cannot start or serve a workload is an
error in its column; the run goes on.

Example:
    $ python -m mlxcache.bench server --quick
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import pathlib
import random
import statistics
import tempfile
import time
from contextlib import ExitStack

import openai

from mlxcache import zoo
from mlxcache.bench.chat_workloads import Step, Workload, all_workloads, words
from mlxcache.bench.processes import anchor_command, free_port, launch, ours_command
from mlxcache.bench.report import format_server_table

__all__ = ["ANCHOR", "FAMILIES", "OURS", "main", "measure", "run", "run_family", "summarize"]

FAMILIES = ("llama", "qwen3_next", "gemma3_text")
OURS = "mlxcache.serve"
ANCHOR = "mlx_lm.server"


@dataclasses.dataclass(frozen=True)
class Answer:
    """One streamed answer: its text, TTFT and the time after it in seconds, and the usage
    it reported."""

    text: str
    ttft_s: float
    decode_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None


async def _ask(client: openai.AsyncOpenAI, model: str, messages: list[dict],
               max_tokens: int) -> Answer:
    start = time.perf_counter()
    ttft, parts, usage = None, [], None
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - start
                parts.append(choice.delta.content)
    if usage is None:
        raise RuntimeError("the stream ended without a usage chunk (include_usage)")
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else None
    total = time.perf_counter() - start
    ttft = total if ttft is None else ttft
    return Answer("".join(parts).strip(), ttft, total - ttft, usage.prompt_tokens,
                  usage.completion_tokens, cached)


async def _session(client, model: str, steps: tuple[Step, ...], max_tokens: int
                   ) -> list[Answer]:
    history: list[dict] = []
    out = []
    for step in steps:
        answer = await _ask(client, model, history + list(step.messages), max_tokens)
        out.append(answer)
        if step.keep:
            history = history + list(step.messages) + [
                {"role": "assistant", "content": answer.text}]
    return out


async def _drive(url: str, model: str, workload: Workload) -> tuple[float, list[Answer]]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                  timeout=600.0) as client:
        start = time.perf_counter()
        answers: list[Answer] = []
        for phase in workload.phases:
            done = await asyncio.gather(*(_session(client, model, s, workload.max_tokens)
                                          for s in phase))
            answers += [a for session in done for a in session]
        return time.perf_counter() - start, answers


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10, method="inclusive")[-1] if len(xs) > 1 else xs[0]


def measure(url: str, model: str, workload: Workload) -> dict:
    """Run ``workload`` against the server at ``url``: its figures and answers (or
    ``{"error": ...}``)."""
    try:
        wall, answers = asyncio.run(_drive(url, model, workload))
    except Exception as e:  # a server's failure is a result, not the end of the run
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    ttfts = [a.ttft_s for a in answers]
    cached = [a.cached_tokens for a in answers]
    prompt = sum(a.prompt_tokens for a in answers)
    later = [a.decode_s / (a.completion_tokens - 1) for a in answers if a.completion_tokens > 1]
    return {"wall_s": wall, "ttft_mean_s": statistics.fmean(ttfts), "ttft_p90_s": _p90(ttfts),
            "decode_s_per_token": statistics.fmean(later) if later else 0.0,
            "prompt_tokens": prompt,
            "computed_tokens": None if None in cached else prompt - sum(cached),
            "answers": [a.text for a in answers]}


TIMES = ("wall_s", "ttft_mean_s", "ttft_p90_s", "decode_s_per_token")
COUNTS = ("prompt_tokens", "computed_tokens")


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Each server's runs of one workload (``runs[server]``, one per repeat) as one entry:
    per server the median of every figure over the repeats; the greedy answers that agree
    between the servers (all repeats); the ratios ours / anchor (times: medians of the
    per-repeat ratios; computed tokens: of the medians) and each repeat's wall-time ratio
    (``wall_ratios``, the spread)."""
    servers: dict = {}
    for name, rs in runs.items():
        bad = [r for r in rs if "error" in r]
        servers[name] = bad[0] if bad else {
            k: (None if None in (vals := [r[k] for r in rs]) else statistics.median(vals))
            for k in TIMES + COUNTS}
    out: dict = {"servers": servers}
    if any("error" in s for s in servers.values()):
        return out
    ours, anchor = runs[OURS], runs[ANCHOR]
    pairs = [(a, b) for o, n in zip(ours, anchor, strict=True)
             for a, b in zip(o["answers"], n["answers"], strict=True)]
    out["agree"], out["total"] = sum(a == b for a, b in pairs), len(pairs)
    ratios = {k: statistics.median(o[k] / n[k] for o, n in zip(ours, anchor, strict=True))
              for k in TIMES if all(n[k] for n in anchor)}
    # the spread: each round's wall-time ratio (a paired median hides how far rounds swing)
    out["wall_ratios"] = [o["wall_s"] / n["wall_s"] for o, n in zip(ours, anchor, strict=True)]
    c_ours, c_anchor = servers[OURS]["computed_tokens"], servers[ANCHOR]["computed_tokens"]
    if c_ours is not None and c_anchor:
        ratios["computed_tokens"] = c_ours / c_anchor
    out["ratios"] = ratios
    return out


def _warm_up(url: str, model: str) -> None:
    """One short request, so neither server's first-request costs land in a workload."""
    messages = [{"role": "user", "content": words(random.Random(99), 32)}]
    asyncio.run(_drive(url, model, Workload("warm", "warm", (((Step(tuple(messages)),),),), 4)))


def _serve_both(family: str, model_dir: pathlib.Path, workdir: pathlib.Path,
                stack: ExitStack) -> tuple[dict, str]:
    """Start both servers on ``model_dir`` and warm them up: ``{name: Launched or None}``
    and the anchor's error (the run goes on without an anchor that cannot start)."""
    p1, p2 = free_port(), free_port()
    ours = stack.enter_context(launch(ours_command(str(model_dir), p1, family), p1, family,
                                      workdir / f"{family}-ours.log"))
    _warm_up(ours.url, ours.model)
    try:
        anchor = stack.enter_context(launch(anchor_command(str(model_dir), p2), p2,
                                            "default_model", workdir / f"{family}-anchor.log"))
        _warm_up(anchor.url, anchor.model)
    except Exception as e:
        return {OURS: ours, ANCHOR: None}, f"{type(e).__name__}: {e}"[:300]
    return {OURS: ours, ANCHOR: anchor}, ""


def run_family(family: str, workdir: pathlib.Path, quick: bool = False,
               repeats: int = 1) -> dict:
    """Both servers on ``family``'s tiny checkpoint; ``repeats`` rounds, each the workloads
    with fresh words, each workload on one server and then the other (the order alternates
    from round to round)."""
    model_dir = workdir / family
    zoo.save_checkpoint(family, model_dir)
    result: dict = {"caches": list(zoo.cache_kinds(zoo.make(family))), "workloads": {}}
    with ExitStack() as stack:
        servers, anchor_error = _serve_both(family, model_dir, workdir, stack)
        runs: dict[str, dict[str, list[dict]]] = {}
        for r in range(repeats):
            for w in all_workloads(quick, seed=1000 * r):
                result["workloads"].setdefault(w.key, {"title": w.title,
                                                       "requests": w.requests})
                order = (OURS, ANCHOR) if r % 2 == 0 else (ANCHOR, OURS)
                for name in order:
                    s = servers[name]
                    runs.setdefault(w.key, {OURS: [], ANCHOR: []})[name].append(
                        measure(s.url, s.model, w) if s is not None
                        else {"error": anchor_error})
    for key, entry in result["workloads"].items():
        entry.update(summarize(runs[key]))
    return result


def run(quick: bool = False, families: tuple[str, ...] = FAMILIES, repeats: int = 1) -> dict:
    """Every family in ``families`` through both servers; the result ``format_server_table``
    prints."""
    with tempfile.TemporaryDirectory(prefix="mlxcache-bench-server-") as tmp:
        models = {f: run_family(f, pathlib.Path(tmp), quick, repeats) for f in families}
    return {"quick": quick, "repeats": repeats, "servers": [OURS, ANCHOR], "models": models}


def main(argv: list[str] | None = None) -> dict:
    """Parse the flags, run, print the table (and write ``--json PATH``)."""
    p = argparse.ArgumentParser(prog="python -m mlxcache.bench server",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller workloads (smoke run)")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--repeats", type=int, default=None,
                   help="rounds of every workload, fresh words each (default 7; 1 with "
                   "--quick)")
    args = p.parse_args(argv)
    # Seven: the workloads take under a second each, and on a shared 2-core machine one
    # round's wall-time ratio swings by tens of percent (llama's multi-turn went from 0.73x to
    # 1.60x over four 3-round runs); the table prints the rounds' range beside the median.
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 7)
    if repeats < 1:
        p.error(f"--repeats {repeats} must be at least 1")
    result = run(args.quick, tuple(args.families), repeats)
    print(format_server_table(result))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return result
