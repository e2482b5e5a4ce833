"""The architecture, checked: folders are layers, imports point down, files stay readable.

Every module of the three packages is parsed (``ast``, function bodies included) and its
first-party imports collected. The test fails on:

- an import that points up: each module belongs to the first entry of ``LAYERS`` whose prefix
  names it, and may import only modules of its own layer or of layers listed before it;
- a cycle between modules (Python runs a module's imports at import time, so a cycle is an
  order-dependent import; one held up by function-local imports is still a cycle);
- a first-party import inside a function or class body (a local import hides a cycle or an
  upward dependency), except in programs (``PROGRAMS``: benchmarks, demo, ``__main__``) and in
  a module-level ``__getattr__`` (PEP 562: a package that imports a heavy half lazily);
- a file over ``MAX_FILE`` lines, a class over ``MAX_CLASS`` or a function over ``MAX_FUNCTION``.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("servecore", "hybridattn", "mlxcache")
MAX_FILE, MAX_CLASS, MAX_FUNCTION = 800, 400, 80

# Bottom first. A module's layer is the first entry with a prefix that names it (a prefix
# names a module and everything inside it).
LAYERS: list[tuple[str, ...]] = [
    ("servecore",),
    ("hybridattn.pytree", "hybridattn.config"),
    ("hybridattn.ops",),
    ("hybridattn.pools",),
    ("hybridattn.backends",),
    ("hybridattn.launch", "hybridattn.mesh"),
    ("hybridattn.models",),
    ("hybridattn.serving",),
    ("hybridattn.sharding",),
    ("hybridattn.engine",),
    ("hybridattn",),  # the package's facade: re-exports the layers below
    ("hybridattn.testing",),
    ("hybridattn.demo",),
    ("hybridattn.serve",),
    ("hybridattn.bench",),
    ("mlxcache.quant",),
    ("mlxcache.radix", "mlxcache.sampling", "mlxcache.logprobs", "mlxcache.pool"),
    ("mlxcache.cache",),
    ("mlxcache.layers",),
    ("mlxcache.engine",),
    ("mlxcache.generate", "mlxcache.zoo"),
    ("mlxcache",),
    ("mlxcache.testing",),
    ("mlxcache.serve",),
    ("mlxcache.bench",),
]
# Programs: they may import lazily (optional heavy dependencies, a subcommand's own setup).
PROGRAMS = ("hybridattn.bench", "hybridattn.demo", "hybridattn.serve", "mlxcache.bench",
            "mlxcache.serve")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The first-party module ``name`` refers to (a module, or the package above a name
    imported from it), or None for a third-party one."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, tree: ast.Module):
    """(line, imported module, local) for every first-party import; ``local`` when inside a
    function or class body, unless that function is a module-level ``__getattr__``."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]

    def visit(node, local):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield child.lineno, alias.name, local
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")
                    up = up[: len(up) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for alias in child.names:
                    yield child.lineno, f"{base}.{alias.name}", local
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                    ast.Lambda)):
                lazy = node is tree and getattr(child, "name", "") == "__getattr__"
                yield from visit(child, local or not lazy)
            else:
                yield from visit(child, local)

    for line, name, local in visit(tree, False):
        target = _resolve(name)
        if target is not None and target != module:
            yield line, target, local


def _layer(module: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS: add it where it belongs")


def _program(module: str) -> bool:
    return module.endswith("__main__") or any(
        module == p or module.startswith(p + ".") for p in PROGRAMS)


TREES = {m: ast.parse(p.read_text(), str(p)) for m, p in MODULES.items()}
GRAPH = {m: sorted(set(_imports(m, t))) for m, t in TREES.items()}


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_imports_point_down():
    up = [f"{m}:{line} imports {t} (layer {_layer(t)} above {_layer(m)})"
          for m, edges in GRAPH.items() for line, t, _ in edges if _layer(t) > _layer(m)]
    assert not up, "\n".join(up)


def test_no_function_local_first_party_imports():
    local = [f"{m}:{line} imports {t} inside a function or class"
             for m, edges in GRAPH.items() if not _program(m)
             for line, t, is_local in edges if is_local]
    assert not local, "\n".join(local)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_no_import_cycles():
    # A package's __init__ importing its own modules is how re-exports work; a module of the
    # package importing the package back (not a sibling directly) closes a cycle.
    graph = {m: {t for _, t, _ in edges} for m, edges in GRAPH.items()}
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_sizes(module):
    path = MODULES[module]
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_FILE, f"{path.relative_to(ROOT)}: {lines} lines"
    big = []
    for node in ast.walk(TREES[module]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            n = node.end_lineno - node.lineno + 1
            limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
            if n > limit:
                big.append(f"{node.name} ({n} lines, limit {limit})")
    assert not big, f"{path.relative_to(ROOT)}: " + ", ".join(big)


FACADES = {"servecore.client": "EngineClient", "hybridattn.engine.engine": "Engine",
           "mlxcache.engine.engine": "Engine"}
MAX_FACADE = 250
"""Lines of each engine's front door: construction and what is truly its own (the calls are
``servecore.client.EngineClient``'s, the options' manual is on the options' fields)."""


@pytest.mark.parametrize("module", sorted(FACADES))
def test_each_front_door_class_is_small(module):
    name = FACADES[module]
    (cls,) = [n for n in TREES[module].body if isinstance(n, ast.ClassDef) and n.name == name]
    lines = cls.end_lineno - cls.lineno + 1
    assert lines < MAX_FACADE, f"{module}.{name}: {lines} lines, limit {MAX_FACADE}"


def _folder(module: str) -> str:
    """The folder a module's file lies in (a package's ``__init__`` in its own)."""
    path = MODULES[module]
    return str(path.parent.relative_to(ROOT))


def _underscore_imports(module: str):
    """(line, what) for every first-party import of an underscore name or module."""
    tree = TREES[module]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module \
                and node.module.split(".")[0] in PACKAGES:
            source = _resolve(node.module)
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                private = alias.name.startswith("_") or any(
                    p.startswith("_") and not p.startswith("__") for p in node.module.split("."))
                if private and source is not None:
                    yield node.lineno, full, _resolve(full) or source
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in PACKAGES and any(p.startswith("_") and not p.startswith("__")
                                                for p in parts):
                    yield node.lineno, alias.name, _resolve(alias.name)


def test_no_underscore_name_crosses_a_folder():
    """A private name (``_name``, or a name inside a ``_module``) is used only in its own
    folder: what another folder needs is public, listed in its module's ``__all__``."""
    bad = [f"{m}:{line} imports {what}" for m in MODULES
           for line, what, source in _underscore_imports(m)
           if source is not None and _folder(source) != _folder(m)]
    assert not bad, "\n".join(bad)
