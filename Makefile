# The two commands a newcomer needs: `make demo` and `make test` (CI also runs `make lint`).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test docs bench bench-plots lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[mlx,test,docs]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hybridattn.demo

# The tests and a strict build of the documentation site, which executes every notebook
# (tests/test_notebooks_and_docs.py), all on two workers; the 10 slowest are listed at the end.
test: $(STAMP)
	$(PY) -m pytest -n 2 -q --durations=10 tests

# site/: every page, the notebooks executed with their plots (mkdocs-jupyter).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The benchmarks page's plots, from a quick run of each (a few minutes); the full runs are
# the tables' figures: `python -m hybridattn.bench WHAT --json > FILE`, then
# `python -m hybridattn.bench WHAT --from-json FILE --plot docs/bench`.
bench-plots: $(STAMP)
	$(PY) -m hybridattn.bench kda --quick --json --plot docs/bench > docs/bench/kda.json
	$(PY) -m hybridattn.bench serve --quick --no-transformers --json --plot docs/bench \
		> docs/bench/serve.json
	$(PY) -m hybridattn.bench prefix --quick --json --plot docs/bench > docs/bench/prefix.json

bench: $(STAMP)
	$(PY) -m hybridattn.bench kda
	$(PY) -m hybridattn.bench serve

# ruff over the whole tree: the packages, tests, docs/_ext and the notebooks.
lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site .cache
