"""An OpenAI- and Anthropic-compatible HTTP server over either engine (the ``[server]``
extra: Starlette and uvicorn).

``create_app(engine, model_name=...)`` is the ASGI application; ``python -m mlxcache.serve``
and ``python -m hybridattn.serve`` run it. Public: ``create_app``, ``Server``, ``APIError``
(here) and ``cli``; the rest are internal layers, each a module:

* ``_worker``: ``EngineWorker``, the one thread that drives the engine; the event loop talks to
  it through queues.
* ``_generation``: ``Ask`` (one call's prompts, n, sampling, stop strings) and ``pieces``, the
  answer as text pieces, with the ``n`` siblings sharing their prompt's cached prefix.
* ``_text``: ``TextStream``, incremental detokenization and stop strings.
* ``_fields``, ``_openai_api``, ``_anthropic_api``: requests read field by field, every refusal a
  400 naming the field (``APIError``), and the objects each API answers with.
* ``_formats``: each route's whole answer and its server-sent events.
* ``_door``: who may call (JSON bodies only, web origins, ``--api-key``).
* ``app``: the routes, the disconnect-watching response, errors; ``_metrics``: ``/metrics``.
* ``cli``: the flags and uvicorn.
"""

from servecore.server._errors import APIError
from servecore.server.app import Server, create_app

__all__ = ["APIError", "Server", "create_app"]
