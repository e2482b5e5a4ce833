"""``python -m hybridattn.serve``: an OpenAI- and Anthropic-compatible HTTP server over
``hybridattn.Engine`` (``servecore.server``; needs the ``[server]`` extra).

``--model DIR`` serves a Kimi-Linear checkpoint directory with its tokenizer. Without it, the
built-in demo model (``hybridattn.demo.demo_config``, random weights) answers through a small
word tokenizer (``servecore.testing.word_tokenizer``: the word ``wN`` is token ``N``), so a
fresh clone can be called at once::

    python -m hybridattn.serve --port 8000
    curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
        -d '{"model": "hybridattn-demo", "messages": [{"role": "user", "content": "w5 w6"}]}'
"""

from __future__ import annotations

import argparse
import sys

import jax

from hybridattn.demo import _use_compilation_cache, demo_config
from hybridattn.engine import Engine
from hybridattn.models import kimi_linear as M
from servecore.server import cli
from servecore.server.cli import add_server_args

__all__ = ["build_engine", "main", "parser"]


def parser() -> argparse.ArgumentParser:
    """The command's flags: the model, the engine's sizing and cache, the server's."""
    p = argparse.ArgumentParser(prog="python -m hybridattn.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Kimi-Linear checkpoint directory with its tokenizer "
                   "(default: the built-in demo model and a word tokenizer)")
    p.add_argument("--trust-remote-code", action="store_true")
    e = p.add_argument_group("engine")
    e.add_argument("--max-running", type=int, default=8, help="requests that run at once")
    e.add_argument("--max-context-len", type=int, default=None,
                   help="longest prompt + answer (default: the engine's)")
    e.add_argument("--num-token-slots", type=int, default=None,
                   help="MLA token slots (default: sized from --mem-fraction)")
    e.add_argument("--mem-fraction", type=float, default=0.5)
    e.add_argument("--chunked-prefill", type=int, default=None,
                   help="prompt tokens per step (default: the engine's)")
    e.add_argument("--decode-steps", type=int, default=1)
    e.add_argument("--no-prefix-cache", action="store_true")
    e.add_argument("--snapshot-interval", type=int, default=None)
    e.add_argument("--seed", type=int, default=0, help="the demo model's weights")
    add_server_args(p, default_name="hybridattn-demo")
    return p


def build_engine(args: argparse.Namespace) -> Engine:
    """The engine the flags describe (its compilations cached on disk, as the demo's)."""
    _use_compilation_cache()
    if args.model:
        tokenizer = M.load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
        if tokenizer is None:
            raise SystemExit(f"--model {args.model!r} has no tokenizer: the server needs one")
        config, params = M.load(args.model)
    else:
        from servecore.testing import word_tokenizer

        config = demo_config()
        params = M.init_params(config, jax.random.key(args.seed))
        tokenizer = word_tokenizer(config.vocab_size)
    options = dict(max_running_requests=args.max_running, mem_fraction=args.mem_fraction,
                   decode_steps=args.decode_steps, prefix_cache=not args.no_prefix_cache)
    for flag, name in (("max_context_len", "max_context_len"),
                       ("num_token_slots", "num_token_slots"),
                       ("chunked_prefill", "chunked_prefill_size"),
                       ("snapshot_interval", "snapshot_interval")):
        if getattr(args, flag) is not None:
            options[name] = getattr(args, flag)
    return Engine(config, params, tokenizer=tokenizer, **options)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and serve until interrupted (``servecore.server.cli.main``)."""
    return cli.main(parser(), build_engine, argv)


if __name__ == "__main__":
    sys.exit(main())
