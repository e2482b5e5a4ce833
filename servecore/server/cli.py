"""What ``python -m mlxcache.serve`` and ``python -m hybridattn.serve`` share: the server's
own flags and running the app under uvicorn.

>>> import argparse
>>> p = argparse.ArgumentParser()
>>> add_server_args(p, default_name="demo")
>>> a = p.parse_args(["--port", "9000"])
>>> a.host, a.port, a.served_model_name, a.max_queue
('127.0.0.1', 9000, 'demo', 256)
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

from servecore.diskcache import DirectoryInUse
from servecore.server.app import create_app

__all__ = ["add_server_args", "int_in", "main", "run", "seconds_in"]


def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an int in ``[lo, hi]`` (``hi`` None: no upper bound), else a
    usage error that says the range.

    >>> int_in(1, 65535)("8000")
    8000
    >>> int_in(1)("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: 0 is not an int >= 1
    """
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo or (hi is not None and value > hi):
            want = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"{text} is not {want}")
        return value

    return parse


def _key(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty key would let anyone in: give a key")
    return text


def _origins(text: str) -> list[str]:
    return [o.strip().rstrip("/") for o in text.split(",") if o.strip()]


def seconds_in(lo: float, hi: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number of seconds in ``[lo, hi]``.

    >>> seconds_in(0.1, 3600)("10")
    10.0
    >>> seconds_in(0.1, 3600)("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: 0 is not a number of seconds in [0.1, 3600]
    """
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not lo <= value <= hi:  # (NaN fails both)
            raise argparse.ArgumentTypeError(f"{text} is not a number of seconds in "
                                             f"[{lo:g}, {hi:g}]")
        return value

    return parse


def add_server_args(parser: argparse.ArgumentParser, *, default_name: str) -> None:
    """The flags of the HTTP side: where to listen, the model's name, the queue.

    >>> p = argparse.ArgumentParser()
    >>> add_server_args(p, default_name="m")
    >>> p.parse_args(["--host", "0.0.0.0"]).host
    '0.0.0.0'
    """
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int_in(0, 65535), default=8000,
                   help="port (default 8000; 0: any free port)")
    g.add_argument("--served-model-name", default=default_name,
                   help="the model name clients send and see (default: the --model "
                   f"directory's name, else {default_name!r})")
    g.add_argument("--max-queue", type=int_in(1), default=256,
                   help="requests that may wait for their first token before more get 429")
    g.add_argument("--max-body-bytes", type=int_in(1), default=8 << 20,
                   help="the largest request body taken (default 8 MiB; 413 past it)")
    g.add_argument("--keepalive", type=seconds_in(0.1, 3600), default=10.0,
                   help="seconds between keep-alive comments while a stream waits (0.1 to "
                   "3600; default 10)")
    g.add_argument("--api-key", type=_key, default=os.environ.get("SERVECORE_API_KEY") or None,
                   help="the key every /v1 request must carry (Authorization: Bearer KEY, or "
                   "x-api-key: KEY); default: $SERVECORE_API_KEY, else none needed")
    g.add_argument("--allowed-origins", default="", type=_origins,
                   help="comma-separated web origins whose pages may call the server (e.g. "
                   "http://localhost:3000; * for any); default: none, so a request a web "
                   "page sends (it carries an Origin header) is refused")
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def run(engine: Any, args: argparse.Namespace) -> None:
    """Serve ``engine`` with the flags ``add_server_args`` added, until interrupted; the
    engine is closed at the end (``python -m hybridattn.serve`` ends with it).

    >>> callable(run)
    True
    """
    import uvicorn

    app = create_app(engine, model_name=args.served_model_name, max_queue=args.max_queue,
                     keepalive=args.keepalive, max_body_bytes=args.max_body_bytes,
                     close_engine=True, api_key=args.api_key,
                     allowed_origins=args.allowed_origins)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        engine.close()


def main(parser: argparse.ArgumentParser, build_engine: Callable[[Any], Any],
         argv: list[str] | None = None) -> int:
    """A serve command: parse ``argv`` with ``parser`` (which has ``add_server_args``' flags
    and ``--model``), build the engine (``build_engine(args)``; a ``ValueError``,
    ``TypeError``, ``OSError`` or a cache directory another server owns is a usage error
    naming the problem, exit status 2) and serve it.

    >>> p = argparse.ArgumentParser(prog="serve")
    >>> add_server_args(p, default_name="m")
    >>> _ = p.add_argument("--model")
    >>> main(p, lambda args: (_ for _ in ()).throw(OSError("no such directory")), [])
    Traceback (most recent call last):
    ...
    SystemExit: 2
    """
    args = parser.parse_args(argv)
    if args.model and args.served_model_name == parser.get_default("served_model_name"):
        args.served_model_name = args.model.rstrip("/").rsplit("/", 1)[-1]
    try:
        engine = build_engine(args)
    except (ValueError, TypeError, OSError, DirectoryInUse) as e:
        parser.error(str(e))
    run(engine, args)
    return 0
