"""Every docstring example in hybridattn runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "hybridattn._pytree",
    "hybridattn.backend",
    "hybridattn.batch",
    "hybridattn.config",
    "hybridattn.models.kimi_linear",
    "hybridattn.ops",
    "hybridattn.pools",
]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} doctest failures in {name}"
