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
from typing import Any

from servecore.server.app import create_app

__all__ = ["add_server_args", "run"]


def add_server_args(parser: argparse.ArgumentParser, *, default_name: str) -> None:
    """The flags of the HTTP side: where to listen, the model's name, the queue.

    >>> p = argparse.ArgumentParser()
    >>> add_server_args(p, default_name="m")
    >>> p.parse_args(["--host", "0.0.0.0"]).host
    '0.0.0.0'
    """
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    g.add_argument("--served-model-name", default=default_name,
                   help=f"the model name clients send and see (default {default_name!r})")
    g.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait for their first token before more get 429")
    g.add_argument("--keepalive", type=float, default=10.0,
                   help="seconds between keep-alive comments while a stream waits")
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
                     keepalive=args.keepalive)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        engine.close()
