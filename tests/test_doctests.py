"""Every docstring example in the API modules runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib

import pytest

from tests.test_api_docs import HYBRIDATTN_API, MLXCACHE_API, SERVECORE_API, mlxcache_params

HYBRIDATTN_MODULES = ["hybridattn", "hybridattn._pytree", *HYBRIDATTN_API]


def _run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} doctest failures in {name}"


@pytest.mark.parametrize("name", HYBRIDATTN_MODULES)
def test_doctests(name):
    _run(name)


@pytest.mark.parametrize("name", mlxcache_params(["mlxcache", *MLXCACHE_API]))
def test_mlxcache_doctests(name):
    _run(name)


@pytest.mark.parametrize("name", ["servecore", *SERVECORE_API])
def test_servecore_doctests(name):
    _run(name)
