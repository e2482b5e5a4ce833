"""``make demo``: serve a hybrid Kimi-Linear model with continuous batching, and check it.

With no arguments it builds a small Kimi-Linear with the released layer pattern (3 KDA : 1 MLA,
repeated; MoE with a shared expert after a dense first layer) and random weights, serves a
batch of requests of mixed lengths through :class:`hybridattn.Engine` (chunked prefill, more
requests than fit at once, one jitted pure ``step`` per round), then checks every generated
token against greedy decoding with the cache-free :func:`~hybridattn.models.kimi_linear.apply`
and prints throughput, time to first token, compilations and memory per token. A second
round then sends requests that share prefixes with the first (follow-up turns: a prompt + its
answer + a new message; and siblings: most of a prompt + a new ending), served with the
engine's prefix cache and, for comparison, by an engine without one: it prints the hit rate
and the time to first token with and without reuse, and checks those tokens too.

``--model DIR`` serves a Hugging Face checkpoint directory instead (``config.json`` plus
``model.safetensors`` or shards) on the same random token-id prompts. With ``--prompt TEXT``
(repeatable) it serves your text instead, through the directory's tokenizer
(``kimi_linear.load_tokenizer``; as one user message of its chat template when it has one,
unless ``--ignore-chat-template``), and prints the decoded continuation of each prompt::

    python -m hybridattn.demo --model DIR --prompt "Why is the sky blue?" --max-tokens 64
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from hybridattn.config import KimiLinearConfig
from hybridattn.engine import Engine
from hybridattn.models import kimi_linear as M
from servecore.prompts import encode_prompts, has_chat_template


def demo_config() -> KimiLinearConfig:
    """The built-in model: 8 layers (KDA at 0-2 and 4-6, MLA at 3 and 7), hidden 128."""
    return KimiLinearConfig.tiny(
        num_hidden_layers=8, hidden_size=128, vocab_size=1024, intermediate_size=256,
        linear_num_heads=4, linear_head_dim=32, num_attention_heads=4, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_experts=8,
        num_experts_per_token=2, moe_intermediate_size=64,
    )


def check_against_apply(params, config, prompts, outputs) -> tuple[int, int, int]:
    """Teacher-forced check of greedy decoding: ``apply`` over each prompt + output; every
    generated token must be the argmax at its position. Returns ``(matched, total,
    near_ties)``: a mismatch counts as a near-tie (and passes) only when the two logits are
    within 1e-4 of the logit scale."""
    seqs = [p + o[:-1] for p, o in zip(prompts, outputs, strict=True)]
    width = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), width), np.int32)  # right padding: causal, so harmless
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    logits = np.asarray(jax.jit(M.apply, static_argnums=1)(params, config, jnp.asarray(ids)))
    scale = np.abs(logits).max()
    matched = total = ties = 0
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        rows = logits[i, len(p) - 1: len(p) - 1 + len(o)]
        for row, tok in zip(rows, o, strict=True):
            total += 1
            best = int(row.argmax())
            if best == tok:
                matched += 1
            elif row[best] - row[tok] <= 1e-4 * scale:
                matched += 1
                ties += 1
    return matched, total, ties


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hybridattn.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Kimi-Linear checkpoint directory (default: built-in)")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=16,
                   help="tokens to generate per request (--max-new-tokens: a deprecated name)")
    p.add_argument("--min-prompt", type=int, default=4)
    p.add_argument("--max-prompt", type=int, default=160)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--chunked-prefill", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the apply-based check")
    p.add_argument("--prompt", action="append",
                   help="text to continue with --model's tokenizer (repeat for several); "
                        "prints the decoded continuations")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="with --prompt: feed the text as is, not as a chat message")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run tokenizer code that ships with the checkpoint (read it first)")
    return p


def _use_compilation_cache() -> None:
    """Compilations are cached on disk (``HYBRIDATTN_JAX_CACHE``; ``0``: off): a second run
    starts at once."""
    cache = os.environ.get("HYBRIDATTN_JAX_CACHE",
                           os.path.join(os.path.expanduser("~"), ".cache", "hybridattn", "jax"))
    if cache != "0":
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _load_tokenizer(args, prog: str):
    """``--prompt``'s tokenizer from ``--model``, loaded before the weights: a missing
    tokenizer should not wait for them."""
    try:
        tokenizer = M.load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    except (ImportError, ValueError, OSError) as e:
        raise SystemExit(f"{prog}: error: {e}") from None
    if tokenizer is None:
        raise SystemExit(f"{prog}: error: --model {args.model!r} has no tokenizer "
                         "(tokenizer.json, tokenizer_config.json, ...): --prompt "
                         "needs one")
    return tokenizer


def _print_model(config: KimiLinearConfig, params, source: str) -> None:
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"Kimi-Linear ({source}): {config.num_hidden_layers} layers "
          f"(KDA {list(config.kda_layer_ids)}, MLA {list(config.full_attention_layer_ids)}), "
          f"hidden {config.hidden_size}, {n_params / 1e6:.2f}M parameters   "
          f"[{jax.default_backend()}]")


def _round_one(args, config, params, rng) -> tuple[Engine, dict, list, list]:
    """Serve ``--requests`` random prompts of mixed lengths on an engine sized for them (and for
    round two's follow-ups), printing what it did: the engine, its geometry, the prompts and
    the outputs."""
    lens = rng.integers(args.min_prompt, args.max_prompt + 1, args.requests)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in lens]
    ctx = int(lens.max()) + args.max_tokens
    ctx = -(-ctx // 64) * 64
    ctx *= 2  # room for the second round's follow-up turns
    R = args.max_running
    # one bucket per dimension: one compilation for prefill / mixed steps, one for decode
    geometry = dict(max_running_requests=R, max_context_len=ctx,
                    chunked_prefill_size=args.chunked_prefill, request_buckets=(R,),
                    token_buckets=(args.chunked_prefill + R,), kv_buckets=(ctx,))
    engine = Engine(config, params, snapshot_interval=32,
                    snapshot_buckets=(args.chunked_prefill // 32 + 3 * R,),
                    **geometry)
    print(f"serving {args.requests} requests (prompts {lens.min()}-{lens.max()} tokens, "
          f"{args.max_tokens} new each), at most {engine.max_running_requests} at once, "
          f"prefill chunks of {args.chunked_prefill} tokens")
    print(engine.memory)
    t0 = time.perf_counter()
    engine.warmup(progress=True)
    print(f"compiled the serving step ({engine.stats.num_compilations} compilations) in "
          f"{time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, args.max_tokens, progress=True)
    _print_round_one(engine, prompts, outputs, time.perf_counter() - t0)
    return engine, geometry, prompts, outputs


def _print_round_one(engine: Engine, prompts: list, outputs: list, wall: float) -> None:
    s = engine.stats
    n_out = sum(len(o) for o in outputs)
    print(f"generated {n_out} tokens in {wall:.1f} s ({s.steps} steps, "
          f"{s.num_compilations} compilations taking {s.compile_seconds:.1f} s)")
    print(f"  prefill {s.prefill_tok_s:9.0f} tok/s   decode {s.decode_tok_s:9.0f} tok/s  "
          f"(steady state, compiling steps excluded)")
    print(f"  time to first token: mean {s.mean_ttft:.2f} s, median "
          f"{float(np.median(s.ttft)):.2f} s (all requests arrive at once: includes waiting "
          f"for a free slot)")
    print(f"  request 0: prompt {prompts[0][:8]}... -> {outputs[0]}")


def _check(params, config, prompts, outputs) -> bool:
    """``check_against_apply``, printed; whether every token matched."""
    matched, total, ties = check_against_apply(params, config, prompts, outputs)
    ok = matched == total
    print(f"check against apply-based greedy decoding: {matched}/{total} tokens match"
          + (f" ({ties} near-ties)" if ties else "") + (": OK" if ok else ": MISMATCH"))
    return ok


def _round_two(args, config, params, engine: Engine, geometry: dict, prompts: list,
               outputs: list, rng) -> bool:
    """Follow-up turns and siblings of round one's requests, served with the prefix cache
    and by an engine without one: the hit rate and time to first token of each, printed;
    whether both gave the same tokens."""
    ctx = geometry["max_context_len"]
    follow = [p + o + rng.integers(0, config.vocab_size, 8).tolist()
              for p, o in zip(prompts[: args.requests // 2], outputs, strict=False)]
    siblings = [p[: max(1, 3 * len(p) // 4)] + rng.integers(0, config.vocab_size, 6).tolist()
                for p in prompts[args.requests // 2:]]
    second = [p[: ctx - args.max_tokens] for p in follow + siblings]
    engine.reset_stats()
    again = engine.generate(second, args.max_tokens)
    hit = engine.stats
    cold = Engine(config, params, prefix_cache=False, **geometry)
    cold.warmup(progress=True)
    base = cold.generate(second, args.max_tokens)
    print(f"round two, {len(second)} requests sharing prefixes with round one "
          f"({len(follow)} follow-up turns, {len(siblings)} siblings): prefix cache hit rate "
          f"{hit.hit_rate:.0%} ({hit.cached_tokens}/{hit.prompt_tokens} prompt tokens), "
          f"{hit.snapshots_taken} KDA state snapshots taken")
    print(f"  time to first token: mean {hit.mean_ttft:.2f} s with reuse vs "
          f"{cold.stats.mean_ttft:.2f} s without; prefill {hit.effective_prefill_tok_s:.0f} vs "
          f"{cold.stats.effective_prefill_tok_s:.0f} tok/s (all prompt tokens per second)")
    same = again == base
    print(f"  tokens with the cache equal the tokens without it: {'OK' if same else 'MISMATCH'}")
    return same


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the command line) and run the demo; 0 when every check
    passed."""
    p = _parser()
    args = p.parse_args(argv)
    if args.prompt and not args.model:
        p.error("--prompt needs --model DIR, a checkpoint with a tokenizer (the built-in "
                "model has none)")
    _use_compilation_cache()
    t_start = time.perf_counter()
    if args.model:
        tokenizer = _load_tokenizer(args, p.prog) if args.prompt else None
        config, params = M.load(args.model, progress=True)
        if args.prompt:
            return _continue(args, config, params, tokenizer, p.prog)
        source = f"checkpoint {args.model}"
    else:
        config = demo_config()
        params = M.init_params(config, jax.random.key(args.seed))
        source = "built-in random weights"
    _print_model(config, params, source)
    rng = np.random.default_rng(args.seed)
    engine, geometry, prompts, outputs = _round_one(args, config, params, rng)
    ok = True
    if not args.no_check:
        ok = _check(params, config, prompts, outputs)
    same = _round_two(args, config, params, engine, geometry, prompts, outputs, rng)
    ok = ok and same
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0 if ok else 1


def _continue(args, config, params, tokenizer, prog: str) -> int:
    """``--prompt``: serve the prompts' text greedily and print each continuation."""
    chat = not args.ignore_chat_template and has_chat_template(tokenizer)
    prompts = [[{"role": "user", "content": t}] if chat else t for t in args.prompt]
    try:
        # encoded here (by the engines' own rule) to size the engine to these prompts: one
        # bucket per dimension, so the warmup compiles all there is (two programs)
        ids = encode_prompts(prompts, tokenizer, config.vocab_size)
        R = min(len(ids), args.max_running)
        ctx = -(-(max(map(len, ids)) + args.max_tokens) // 64) * 64
        engine = Engine(config, params, tokenizer=tokenizer, max_running_requests=R,
                        max_context_len=ctx, chunked_prefill_size=args.chunked_prefill,
                        request_buckets=(R,), token_buckets=(args.chunked_prefill + R,),
                        kv_buckets=(ctx,))
        engine.warmup(progress=True)
        texts = engine.generate(ids, args.max_tokens, text=True, progress=True)
    except ValueError as e:  # a prompt or a size the engine refused, named
        raise SystemExit(f"{prog}: error: {e}") from None
    for i, text in enumerate(texts):
        print(text if len(texts) == 1 else f"[{i}] {text}", flush=True)
    s = engine.stats
    print(f"{s.prompt_tokens} prompt tokens; prefill {s.prefill_tok_s:.0f} tok/s, decode "
          f"{s.decode_tok_s:.0f} tok/s (steps that compiled left out)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
