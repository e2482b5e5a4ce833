"""``python -m mlxcache.bench server [--quick] [--json PATH] [--families ...]``: the same chat
workloads sent through the ``openai`` client to ``python -m mlxcache.serve`` and to mlx-lm's
own ``mlx_lm.server`` (the anchor), each a real subprocess on 127.0.0.1.

For each family (``llama``: ``KVCache``; ``qwen3_next``: hybrid, gated-delta ``ArraysCache``
layers and a full-attention layer; ``gemma3_text``: a sliding window of ``zoo.SLIDING_WINDOW``
tokens and a global layer) ``zoo.save_checkpoint`` writes the tiny random model and the word
tokenizer into a temporary directory; both servers load it, each answers one warm-up request,
then every workload of ``chat_workloads`` runs on one server and then the other (each server
keeps its own prompt cache; the workloads share no prompts). Every request is a streamed
chat completion at temperature 0 with ``stream_options.include_usage``. Per workload and
server: the total wall time, mean and p90 TTFT (send to first content chunk), the prompt
tokens, the prompt tokens computed (``usage.prompt_tokens`` minus
``usage.prompt_tokens_details.cached_tokens``, summed; "n/a" where a server reports no cached
count), and how many greedy answers equal the other server's. Ratios are ours / anchor (below
1 is better for time and computed tokens). A server that cannot start or serve a workload is
an error in its column; the run goes on.

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

__all__ = ["FAMILIES", "OURS", "ANCHOR", "main", "run", "run_family"]

FAMILIES = ("llama", "qwen3_next", "gemma3_text")
OURS = "mlxcache.serve"
ANCHOR = "mlx_lm.server"


@dataclasses.dataclass(frozen=True)
class Answer:
    """One streamed answer: its text, TTFT in seconds, and the usage it reported."""

    text: str
    ttft_s: float
    prompt_tokens: int
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
    return Answer("".join(parts).strip(), time.perf_counter() - start if ttft is None else ttft,
                  usage.prompt_tokens, cached)


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
    return {"wall_s": wall, "ttft_mean_s": statistics.fmean(ttfts), "ttft_p90_s": _p90(ttfts),
            "prompt_tokens": prompt,
            "computed_tokens": None if None in cached else prompt - sum(cached),
            "answers": [a.text for a in answers]}


def _compare(ours: dict, anchor: dict) -> dict:
    out: dict = {}
    if "error" in ours or "error" in anchor:
        return out
    pairs = list(zip(ours["answers"], anchor["answers"], strict=True))
    out["agree"] = sum(a == b for a, b in pairs)
    out["total"] = len(pairs)
    ratios = {k: ours[k] / anchor[k] for k in ("wall_s", "ttft_mean_s", "ttft_p90_s")}
    if ours["computed_tokens"] is not None and anchor["computed_tokens"]:
        ratios["computed_tokens"] = ours["computed_tokens"] / anchor["computed_tokens"]
    out["ratios"] = ratios
    return out


def _warm_up(url: str, model: str) -> None:
    """One short request, so neither server's first-request costs land in a workload."""
    messages = [{"role": "user", "content": words(random.Random(99), 32)}]
    asyncio.run(_drive(url, model, Workload("warm", "warm", (((Step(tuple(messages)),),),), 4)))


def run_family(family: str, workloads: list[Workload], workdir: pathlib.Path) -> dict:
    """Both servers on ``family``'s tiny checkpoint, every workload on each in turn."""
    model_dir = workdir / family
    zoo.save_checkpoint(family, model_dir)
    caches = list(zoo.cache_kinds(zoo.make(family)))
    result: dict = {"caches": caches, "workloads": {}}
    p1, p2 = free_port(), free_port()
    with ExitStack() as stack:
        ours = stack.enter_context(launch(ours_command(str(model_dir), p1, family), p1, family,
                                          workdir / f"{family}-ours.log"))
        _warm_up(ours.url, ours.model)
        anchor, anchor_error = None, ""
        try:  # if the anchor cannot start or serve, our column still runs
            anchor = stack.enter_context(launch(anchor_command(str(model_dir), p2), p2,
                                                "default_model",
                                                workdir / f"{family}-anchor.log"))
            _warm_up(anchor.url, anchor.model)
        except Exception as e:
            anchor, anchor_error = None, f"{type(e).__name__}: {e}"[:300]
        for w in workloads:
            result["workloads"][w.key] = _one(w, ours, anchor, anchor_error)
    return result


def _one(w: Workload, ours, anchor, anchor_error: str = "") -> dict:
    servers = {OURS: measure(ours.url, ours.model, w),
               ANCHOR: (measure(anchor.url, anchor.model, w) if anchor is not None
                        else {"error": anchor_error})}
    return {"title": w.title, "requests": w.requests, "servers": servers,
            **_compare(servers[OURS], servers[ANCHOR])}


def run(quick: bool = False, families: tuple[str, ...] = FAMILIES) -> dict:
    """Every family in ``families`` through both servers; the result ``format_server_table``
    prints."""
    workloads = all_workloads(quick)
    with tempfile.TemporaryDirectory(prefix="mlxcache-bench-server-") as tmp:
        models = {f: run_family(f, workloads, pathlib.Path(tmp)) for f in families}
    return {"quick": quick, "servers": [OURS, ANCHOR], "models": models}


def main(argv: list[str] | None = None) -> dict:
    """Parse the flags, run, print the table (and write ``--json PATH``)."""
    p = argparse.ArgumentParser(prog="python -m mlxcache.bench server",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller workloads (smoke run)")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    args = p.parse_args(argv)
    result = run(args.quick, tuple(args.families))
    print(format_server_table(result))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return result
