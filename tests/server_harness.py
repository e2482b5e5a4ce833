"""The server tests' harness: an engine of each kind with a word tokenizer, and
``serving(engine)``, a real uvicorn server on 127.0.0.1 (a free port) in a thread.

The hybridattn engine is ``harness.engine()``'s geometry (its steps are in the compile cache);
the mlxcache engine serves ``mlxcache.zoo``'s tiny llama. Both speak the word tokenizer: the
word ``wN`` is token ``N``.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

MODEL = "test-model"


def within(fn: Any, seconds: float) -> Any:
    """``fn()`` on a helper thread; its result, or a failure (not a hang) if it deadlocks."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} did not return within {seconds} s"
    return out[0]


def hybrid_engine(**kw: Any):
    from harness import CFG, ENGINE, PARAMS

    from hybridattn import Engine
    from servecore.testing import word_tokenizer

    return Engine(CFG, PARAMS, **{**ENGINE, "tokenizer": word_tokenizer(CFG.vocab_size), **kw})


def mlx_engine(family: str = "llama", **kw: Any):
    from mlxcache import Engine, zoo
    from servecore.testing import word_tokenizer

    return Engine(zoo.make(family), word_tokenizer(zoo.VOCAB), **kw)


class Running:
    """A server ``serving`` started: ``url`` (``http://127.0.0.1:PORT``), ``base``
    (``url + "/v1"``), ``port``, the ``app`` and its ``server`` (``servecore.server.Server``)."""

    def __init__(self, app: Any, port: int):
        self.app, self.port = app, port
        self.server = app.state.server
        self.url = f"http://127.0.0.1:{port}"
        self.base = self.url + "/v1"

    def openai(self, **kw: Any):
        import openai

        return openai.OpenAI(base_url=self.base, api_key="none", max_retries=0, **kw)

    def anthropic(self, **kw: Any):
        import anthropic

        return anthropic.Anthropic(base_url=self.url, api_key="none", max_retries=0, **kw)

    def idle(self, timeout: float = 10.0) -> None:
        """Wait until the worker has nothing running and nothing waiting."""
        end = time.monotonic() + timeout
        w = self.server.worker
        while w.running or w.waiting:
            if time.monotonic() > end:
                raise AssertionError(f"not idle after {timeout} s: {w.running} running, "
                                     f"{w.waiting} waiting")
            time.sleep(0.02)


@contextlib.contextmanager
def serving(engine: Any, **kw: Any) -> Iterator[Running]:
    """Serve ``engine`` over HTTP on 127.0.0.1 for the block (``kw``: ``create_app``'s)."""
    import uvicorn

    from servecore.server import create_app

    app = create_app(engine, model_name=kw.pop("model_name", MODEL), **kw)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > end:
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield Running(app, port)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
