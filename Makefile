# `make demo` and `make test` each create .venv when it is missing and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast benchmark clean

demo: $(VENV)/.demo-installed
	$(PY) -m estimatorch demo

test: $(VENV)/.dev-installed
	$(PY) -m pytest

# Everything but the slow, multi-process and notebook tests: for the edit-run cycle.
test-fast: $(VENV)/.dev-installed
	$(PY) -m pytest -m "not slow and not distributed and not notebook"

benchmark: $(VENV)/.dev-installed
	$(PY) benchmarks/overhead.py

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.demo-installed: $(PY) setup.cfg setup.py requirements-demo.txt
	$(PY) -m pip install --quiet -r requirements-demo.txt
	touch $@

$(VENV)/.dev-installed: $(PY) setup.cfg setup.py requirements-dev.txt
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@ $(VENV)/.demo-installed

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
