"""The property tests on docs/testing.md run, and pass: the page shows working code."""

from __future__ import annotations

import pathlib
import re

import pytest

from tests.conftest import HAVE_MLX

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "testing.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def test_the_page_has_its_three_examples():
    assert len(BLOCKS) == 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_docs_testing_example(index):
    code = BLOCKS[index]
    if "mlxcache" in code and not HAVE_MLX:
        pytest.skip("mlx not installed")
    namespace: dict = {"__name__": f"docs_testing_example_{index}"}
    exec(compile(code, f"{PAGE}:block{index}", "exec"), namespace)
    tests = [f for name, f in namespace.items() if name.startswith("test_") and callable(f)]
    assert tests, "the example defines no test"
    for test in tests:
        test()
