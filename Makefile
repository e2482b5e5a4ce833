# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[mlx,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hybridattn.demo

test: $(STAMP)
	$(PY) -m pytest -n 2 -q tests

bench: $(STAMP)
	$(PY) -m hybridattn.bench kda
	$(PY) -m hybridattn.bench serve

lint: $(STAMP)
	$(PY) -m ruff check hybridattn mlxcache tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
