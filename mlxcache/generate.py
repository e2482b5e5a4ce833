"""Command line: generate text from a local mlx-lm checkpoint with the mlxcache engine.

``python -m mlxcache.generate --model DIR --prompt TEXT [--prompt TEXT ...]`` loads ``DIR``
with ``mlx_lm.load`` (a local directory: config.json, safetensors weights, tokenizer files;
nothing is downloaded) and serves every prompt concurrently, sharing cached prefixes. One
prompt streams its text as it is generated; several print one completion each, in order.

Every flag is checked before the model is loaded, for the same ranges the engine checks; a bad
flag, a directory that does not load, or a prompt the engine refuses ends the program with a
one-line message naming it (``SystemExit``, exit status 1), not a traceback.

Example:
    $ python -m mlxcache.generate --model ./tiny-llama --prompt "hello world" --max-tokens 16
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from mlx_lm import load

from mlxcache.engine import Engine, check_options
from mlxcache.pool import PoolExhausted
from servecore.prompts import has_chat_template
from servecore.sampling import SamplingParams
from servecore.validate import check_int, eos_token_ids

PROG = "python -m mlxcache.generate"

# The flag behind each checked name, so that an error names what the user typed.
_FLAGS = {
    "max_tokens": "--max-tokens",
    "temperature": "--temp",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "seed": "--seed",
    "num_slots": "--num-slots",
    "page_size": "--page-size",
    "mem_fraction": "--mem-fraction",
    "kv_bits": "--kv-bits",
    "kv_group_size": "--kv-group-size",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
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
    p.add_argument("--kv-bits", type=int, default=None, choices=(4, 8),
                   help="quantize the K/V to 4 or 8 bits (default: full precision)")
    p.add_argument("--kv-group-size", type=int, default=64, choices=(32, 64, 128),
                   help="values per quantization group")
    p.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt text as is")
    p.add_argument("--verbose", action="store_true", help="log the pool size and print stats")
    return p.parse_args(argv)


def _fail(message: str) -> SystemExit:
    return SystemExit(f"{PROG}: error: {message}")


def check_flags(args: argparse.Namespace) -> None:
    """Check every flag before anything is loaded: SystemExit naming the first bad one."""
    try:
        check_int("max_tokens", args.max_tokens, 1)
        SamplingParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        check_options(num_slots=args.num_slots, page_size=args.page_size,
                      mem_fraction=args.mem_fraction, kv_bits=args.kv_bits,
                      kv_group_size=args.kv_group_size)
    except ValueError as e:
        name, _, rest = str(e).partition("=")
        raise _fail(f"{_FLAGS[name]}={rest}" if name in _FLAGS else str(e)) from None
    if not Path(args.model).is_dir():
        raise _fail(f"--model {args.model!r} is not a directory (local checkpoints only)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_flags(args)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        model, tokenizer = load(args.model)
    except Exception as e:  # whatever the loader met, the directory is the problem
        raise _fail(f"cannot load --model {args.model!r}: {type(e).__name__}: {e}") from None
    try:
        _serve(args, model, tokenizer)
    except (ValueError, PoolExhausted) as e:  # a prompt or setting the engine refused
        raise _fail(str(e)) from None


def _serve(args: argparse.Namespace, model, tokenizer) -> None:
    engine = Engine(
        model,
        tokenizer,
        num_slots=args.num_slots,
        page_size=args.page_size,
        mem_fraction=args.mem_fraction,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
    )
    eos = eos_token_ids(tokenizer)
    # Each prompt as one user message when the tokenizer has a chat template (the engine
    # renders it), else as plain text.
    chat = not args.ignore_chat_template and has_chat_template(tokenizer)
    prompts = [[{"role": "user", "content": p}] if chat else p for p in args.prompt]
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
            if token in eos:
                break
            detok.add_token(token)
            print(detok.last_segment, end="", flush=True)
        detok.finalize()
        print(detok.last_segment, flush=True)
    else:
        for i, text in enumerate(engine.generate(prompts, **sampling, text=True)):
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
