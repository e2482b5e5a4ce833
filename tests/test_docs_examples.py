"""The code on the documentation pages runs: docs/testing.md's property tests pass, and
docs/getting-started.md's first ``step`` loop runs as printed (blocks that name a placeholder
checkpoint path, ``path/to/...``, are illustrations and are skipped)."""

from __future__ import annotations

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def _blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)


TESTING = _blocks("testing.md")
GETTING_STARTED = [b for b in _blocks("getting-started.md")
                   if "path/to" not in b and "def serve(engine)" not in b]
# (the function that runs on either engine: tests/test_front_door.py runs it on both)


def _run(page, index, code) -> dict:
    namespace: dict = {"__name__": f"docs_example_{index}"}
    exec(compile(code, f"{DOCS / page}:block{index}", "exec"), namespace)
    return namespace


def test_the_pages_have_their_examples():
    assert len(TESTING) == 3
    assert len(GETTING_STARTED) == 1


@pytest.mark.parametrize("index", range(len(TESTING)))
def test_docs_testing_example(index):
    namespace = _run("testing.md", index, TESTING[index])
    tests = [f for name, f in namespace.items() if name.startswith("test_") and callable(f)]
    assert tests, "the example defines no test"
    for test in tests:
        test()


def test_getting_started_step_loop():
    ns = _run("getting-started.md", 0, GETTING_STARTED[0])
    assert ns["tokens"].shape == (8, 2)
    assert int(ns["state"].token_allocator.num_used) == 0  # release gave every slot back
