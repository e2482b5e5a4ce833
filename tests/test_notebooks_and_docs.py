"""The notebooks are committed without outputs, and the documentation site builds strictly.

The notebooks themselves are executed by nbmake (``make test`` passes ``--nbmake notebooks``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_four_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names == [
        "01_kda_from_scratch.ipynb",
        "02_hybrid_backend_tour.ipynb",
        "03_train_tiny_hybrid.ipynb",
        "04_mlx_radix_cache.ipynb",
    ], names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_outputs_are_stripped(path):
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        assert cell.get("outputs") == [], f"{path.name} cell {i} has outputs: strip them"
        assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count"


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None and not os.environ.get("CI"),
    reason="mkdocs not installed (pip install -e '.[docs]'); `make test` installs it",
)
def test_docs_build_strictly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
