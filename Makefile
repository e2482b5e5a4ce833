# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test docs bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[mlx,test,docs]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hybridattn.demo

# The tests and a strict build of the documentation site, which executes every notebook
# (tests/test_notebooks_and_docs.py), all on two workers.
test: $(STAMP)
	$(PY) -m pytest -n 2 -q tests

# site/: every page, the notebooks executed with their plots (mkdocs-jupyter).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench: $(STAMP)
	$(PY) -m hybridattn.bench kda
	$(PY) -m hybridattn.bench serve

lint: $(STAMP)
	$(PY) -m ruff check hybridattn mlxcache servecore tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site .cache
