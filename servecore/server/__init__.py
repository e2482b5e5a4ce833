"""An OpenAI- and Anthropic-compatible HTTP server over either engine (the ``[server]``
extra: Starlette and uvicorn).

``create_app(engine, model_name=...)`` is the ASGI application; ``python -m mlxcache.serve``
and ``python -m hybridattn.serve`` run it. The layers, each a module:

* ``worker``: ``EngineWorker``, the one thread that drives the engine; the event loop talks to
  it through queues.
* ``generation``: ``Ask`` (one call's prompts, n, sampling, stop strings) and ``pieces``, the
  answer as text pieces, with the ``n`` siblings sharing their prompt's cached prefix.
* ``text``: ``TextStream``, incremental detokenization and stop strings.
* ``fields``, ``openai_api``, ``anthropic_api``: requests read field by field, every refusal a
  400 naming the field (``errors.APIError``), and the objects each API answers with.
* ``formats``: each route's whole answer and its server-sent events.
* ``app``: the routes, the disconnect-watching response, errors; ``metrics``: ``/metrics``.
* ``cli``: the flags and uvicorn.
"""

from servecore.server.app import Server, create_app
from servecore.server.errors import APIError

__all__ = ["APIError", "Server", "create_app"]
