"""Every docstring example in the API modules runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

from tests.test_api_docs import HYBRIDATTN_API, MLXCACHE_API, SERVECORE_API, mlxcache_params

HYBRIDATTN_MODULES = ["hybridattn", "hybridattn.pytree", *HYBRIDATTN_API]
LISTED = {*HYBRIDATTN_MODULES, *MLXCACHE_API, *SERVECORE_API}


def _run(name):
    """The examples of module ``name`` and, for a package below the top level, of every module
    in it that is not listed on its own (whose names the package re-exports: ``testmod`` reads
    only what a module defines itself): each module's examples run once."""
    module = importlib.import_module(name)
    modules = [module]
    if hasattr(module, "__path__") and "." in name:
        modules += [importlib.import_module(m.name)
                    for m in pkgutil.walk_packages(module.__path__, name + ".")
                    if m.name not in LISTED]
    for mod in modules:
        result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
        assert result.failed == 0, f"{result.failed} doctest failures in {mod.__name__}"


@pytest.mark.parametrize("name", HYBRIDATTN_MODULES)
def test_doctests(name):
    _run(name)


@pytest.mark.parametrize("name", mlxcache_params(["mlxcache", *MLXCACHE_API]))
def test_mlxcache_doctests(name):
    _run(name)


@pytest.mark.parametrize("name", ["servecore", *SERVECORE_API])
def test_servecore_doctests(name):
    _run(name)
