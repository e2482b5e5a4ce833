"""Every public name is documented: a docstring, and for functions and classes a short example;
every public module has an API page and no internal one (a name with an underscore) has.

"Public" is each API module's ``__all__``. A function or class docstring must contain a
doctest example (``>>>``; ``tests/test_doctests.py`` runs them), and a function whose arguments
are arrays must say their shapes in its signature with jaxtyping (``Float[Array, "B T H Dk"]``).
Public methods and properties of public classes need a docstring.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re

import pytest

HYBRIDATTN_API = [
    "hybridattn.ops.kda",
    "hybridattn.ops.conv",
    "hybridattn.ops.mla",
    "hybridattn.config",
    "hybridattn.pools.allocator",
    "hybridattn.pools.requests",
    "hybridattn.pools.indexing",
    "hybridattn.pools.mla",
    "hybridattn.pools.states",
    "hybridattn.backends.base",
    "hybridattn.backends.batch",
    "hybridattn.backends.mla",
    "hybridattn.backends.kda",
    "hybridattn.backends.hybrid",
    "hybridattn.serving.state",
    "hybridattn.serving.worker_batch",
    "hybridattn.serving.sampling",
    "hybridattn.serving.one_step",
    "hybridattn.serving.decode",
    "hybridattn.serving.rows",
    "hybridattn.mesh",
    "hybridattn.launch",
    "hybridattn.sharding",
    "hybridattn.engine",
    "hybridattn.engine.engine",
    "hybridattn.engine.options",
    "hybridattn.engine.sizing",
    "hybridattn.engine.buckets",
    "hybridattn.engine.plan",
    "hybridattn.engine.scheduler",
    "hybridattn.engine._prefix_cache",
    "hybridattn.engine._core",
    "hybridattn.engine.processes",
    "hybridattn.engine._runner",
    "hybridattn.engine._commit",
    "hybridattn.engine.stats",
    "hybridattn.models.kimi_linear",
    "hybridattn.models.kimi_linear.params",
    "hybridattn.models.kimi_linear.primitives",
    "hybridattn.models.kimi_linear.mlp",
    "hybridattn.models.kimi_linear.layers",
    "hybridattn.models.kimi_linear.stacking",
    "hybridattn.models.kimi_linear.layout",
    "hybridattn.models.kimi_linear.forward",
    "hybridattn.models.kimi_linear.reference",
    "hybridattn.models.kimi_linear.checkpoint",
    "hybridattn.models.kimi_linear.partitioning",
    "hybridattn.testing",
]
MLXCACHE_API = [
    "mlxcache.pool",
    "mlxcache.quant",
    "mlxcache.radix",
    "mlxcache.cache",
    "mlxcache.layers",
    "mlxcache.engine",
    "mlxcache.engine.engine",
    "mlxcache.engine.support",
    "mlxcache.engine.options",
    "mlxcache.engine.stats",
    "mlxcache.engine.sizing",
    "mlxcache.engine.memory",
    "mlxcache.engine._forward",
    "mlxcache.engine._job",
    "mlxcache.engine._store",
    "mlxcache.engine._disk",
    "mlxcache.engine._admission",
    "mlxcache.engine._core",
    "mlxcache.engine._path_pooled",
    "mlxcache.engine._path_plain",
    "mlxcache.sampling",
    "mlxcache.logprobs",
    "mlxcache.testing",
    "mlxcache.zoo",
]
SERVECORE_API = [
    "servecore.sampling",
    "servecore.client",
    "servecore.errors",
    "servecore.ids",
    "servecore.stats",
    "servecore.memory",
    "servecore.validate",
    "servecore.radix",
    "servecore.snapshots",
    "servecore.prefix",
    "servecore.diskcache",
    "servecore.diskcache.keys",
    "servecore.diskcache.pagefile",
    "servecore.diskcache.index",
    "servecore.diskcache.store",
    "servecore.prompts",
    "servecore.progress",
    "servecore.requests",
    "servecore.streams",
    "servecore.engine",
    "servecore.thread",
    "servecore.testing",
    "servecore.server",
    "servecore.server._errors",
    "servecore.server._fields",
    "servecore.server._text",
    "servecore.server._worker",
    "servecore.server._generation",
    "servecore.server._openai_api",
    "servecore.server._anthropic_api",
    "servecore.server._formats",
    "servecore.server._metrics",
    "servecore.server.app",
    "servecore.server.cli",
]
NEEDS_MLX = {n for n in MLXCACHE_API if n not in ("mlxcache.radix", "mlxcache.testing")}


def mlxcache_params(names):
    """``names`` as pytest params, the modules that import MLX marked ``mlx``."""
    return [pytest.param(n, marks=pytest.mark.mlx) if n in NEEDS_MLX else n for n in names]


def _public(module):
    assert hasattr(module, "__all__"), f"{module.__name__} has no __all__"
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            yield name, obj


def _members(cls):
    for name, attr in vars(cls).items():
        if name.startswith("_"):
            continue
        fn = attr.__func__ if isinstance(attr, classmethod | staticmethod) else attr
        if inspect.isfunction(fn) or isinstance(attr, property):
            yield name, attr


def _problems(module_name):
    module = importlib.import_module(module_name)
    problems = []
    for name, obj in _public(module):
        where = f"{module_name}.{name}"
        doc = inspect.getdoc(obj) or ""
        if not doc:
            problems.append(f"{where}: no docstring")
        elif ">>>" not in doc and not (inspect.isclass(obj) and issubclass(obj, Exception)):
            problems.append(f"{where}: no example (>>>) in its docstring")
        if inspect.isfunction(obj):
            problems += [f"{where}: {p}" for p in _unshaped(obj)]
        if inspect.isclass(obj):
            for member, attr in _members(obj):
                if not (inspect.getdoc(attr) or "").strip():
                    problems.append(f"{where}.{member}: no docstring")
    return problems


# An array argument annotated without its shape (``jax.Array`` rather than jaxtyping's
# ``Float[Array, "B T"]``); the string form, as ``from __future__ import annotations`` keeps it.
_BARE_ARRAY = re.compile(r"^(jax\.Array|jnp\.ndarray|Array|mx\.array)( \| None)?$")


def _unshaped(fn):
    for name, param in inspect.signature(fn).parameters.items():
        ann = param.annotation
        if isinstance(ann, str) and _BARE_ARRAY.match(ann.strip()):
            yield f"argument {name!r} is annotated {ann!r}: give its shape (jaxtyping)"


@pytest.mark.parametrize("module_name", HYBRIDATTN_API)
def test_hybridattn_public_names_documented(module_name):
    problems = _problems(module_name)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module_name", mlxcache_params(MLXCACHE_API))
def test_mlxcache_public_names_documented(module_name):
    problems = _problems(module_name)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module_name", SERVECORE_API)
def test_servecore_public_names_documented(module_name):
    problems = _problems(module_name)
    assert not problems, "\n".join(problems)


def test_top_level_names_are_public_names_of_api_modules():
    import hybridattn

    for name in hybridattn.__all__:
        obj = getattr(hybridattn, name)
        if inspect.ismodule(obj):
            continue
        home = obj.__module__
        assert home in HYBRIDATTN_API + SERVECORE_API, (
            f"hybridattn.{name} lives in {home}, not an API module")
        assert name in importlib.import_module(home).__all__, f"{name} not in {home}.__all__"


API_PAGES = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api"


def _internal(module_name: str) -> bool:
    return any(part.startswith("_") for part in module_name.split("."))


def test_the_public_modules_have_pages_and_the_internal_ones_none():
    listed = HYBRIDATTN_API + MLXCACHE_API + SERVECORE_API
    pages = {p.stem for p in API_PAGES.glob("*.md")} - {"index"}
    public = {m for m in listed if not _internal(m)}
    assert not pages - set(listed), f"pages of no listed module: {sorted(pages - set(listed))}"
    assert not public - pages, f"public modules without a page: {sorted(public - pages)}"
    internal = {m for m in listed if _internal(m)} & pages
    assert not internal, f"internal modules with a page: {sorted(internal)}"
