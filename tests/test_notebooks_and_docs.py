"""The notebooks are committed without outputs, and the documentation site builds strictly,
with every notebook executed on its page (plots included).

This build is where the test suite runs the notebooks (mkdocs-jupyter executes them, and a
failing cell fails the build): once, not again under nbmake. It is the suite's longest test
(about four minutes on two cores), so ``conftest.py`` puts it first, where a worker starts it
while the other one takes the rest.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
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


# An image in a built notebook page: mkdocs-jupyter inlines each plot as a base64 PNG.
_IMAGE = re.compile(r'<img [^>]*src="data:image/png;base64,[A-Za-z0-9+/=]{1000,}"')


def _figures(path: pathlib.Path) -> int:
    """How many plots the notebook shows (its cells' ``plt.show()`` calls)."""
    cells = json.loads(path.read_text())["cells"]
    return sum("".join(c["source"]).count("plt.show()") for c in cells
               if c["cell_type"] == "code")


@pytest.mark.skipif(
    (importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocs_jupyter")
     is None) and not os.environ.get("CI"),
    reason="mkdocs / mkdocs-jupyter not installed (pip install -e '.[docs]'); `make test` "
           "installs them",
)
def test_docs_build_strictly_with_the_executed_notebooks(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=1500,
        # the notebooks are executed afresh, whatever a cache holds
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "MKDOCS_JUPYTER_CACHE": "false"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    for path in NOTEBOOKS:
        page = (site / "notebooks" / path.stem / "index.html").read_text()
        figures = _figures(path)
        assert figures >= 1, f"{path.name} shows no plot"
        assert len(_IMAGE.findall(page)) >= figures, f"{path.name}: its page lacks its plots"
        assert 'class="jp-OutputArea' in page, f"{path.name}: its page has no outputs"
    bench = (site / "benchmarks" / "index.html").read_text()
    for name in ("kda", "serve", "prefix"):
        assert f'src="../bench/{name}.png"' in bench, f"the benchmarks page lacks {name}.png"
        assert (site / "bench" / f"{name}.png").stat().st_size > 5000
