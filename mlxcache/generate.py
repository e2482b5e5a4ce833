"""Command line: generate text from a local mlx-lm checkpoint with the mlxcache engine.

``python -m mlxcache.generate --model DIR --prompt TEXT [--prompt TEXT ...]`` loads ``DIR``
with ``mlx_lm.load`` (a local directory: config.json, safetensors weights, tokenizer files;
nothing is downloaded) and serves every prompt concurrently, sharing cached prefixes. One
prompt streams its text as it is generated; several print one completion each, in order.

Example:
    $ python -m mlxcache.generate --model ./tiny-llama --prompt "hello world" --max-tokens 16
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from mlx_lm import load

from mlxcache.engine import Engine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m mlxcache.generate", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", required=True, help="local mlx-lm model directory")
    p.add_argument(
        "--prompt", required=True, action="append", help="prompt text (repeat for several)"
    )
    p.add_argument("--max-tokens", type=int, default=100, help="tokens to generate per prompt")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k filter (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--num-slots", type=int, default=None, help="KV pool size (default: auto)")
    p.add_argument("--page-size", type=int, default=1, help="radix tree page size in tokens")
    p.add_argument("--mem-fraction", type=float, default=0.5, help="memory share for the pool")
    p.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt text as is")
    p.add_argument("--verbose", action="store_true", help="log the pool size and print stats")
    return p.parse_args(argv)


def _encode(tokenizer, text: str, chat: bool) -> list[int] | str:
    if chat and getattr(tokenizer, "chat_template", None):
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True
            )
        )
    return text


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if not Path(args.model).is_dir():
        raise SystemExit(f"--model {args.model!r} is not a directory (local checkpoints only)")
    model, tokenizer = load(args.model)
    engine = Engine(
        model,
        tokenizer,
        num_slots=args.num_slots,
        page_size=args.page_size,
        mem_fraction=args.mem_fraction,
    )
    prompts = [_encode(tokenizer, p, not args.ignore_chat_template) for p in args.prompt]
    sampling = dict(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    if len(prompts) == 1:
        detok = tokenizer.detokenizer
        detok.reset()
        for _, token in engine.stream(prompts, **sampling):
            if token in tokenizer.eos_token_ids:
                break
            detok.add_token(token)
            print(detok.last_segment, end="", flush=True)
        detok.finalize()
        print(detok.last_segment, flush=True)
    else:
        for i, tokens in enumerate(engine.generate(prompts, **sampling)):
            text = tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])
            print(f"[{i}] {text}", flush=True)
    if args.verbose:
        s = engine.stats
        print(
            f"requests {s.requests}, prompt tokens {s.prompt_tokens} ({s.hit_rate:.0%} cached), "
            f"prefill {s.effective_prefill_tok_s:.1f} tok/s ({s.prefill_tok_s:.1f} computed), "
            f"decode {s.decode_tok_s:.1f} tok/s, mean TTFT {s.mean_ttft * 1e3:.1f} ms",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
