# `make demo` and `make test` each create .venv when it is missing and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# e.g. make demo DEMO_ARGS=--fresh (python -m estimatorch demo --help lists them)
DEMO_ARGS ?=
# The suite's processes (pytest-xdist): each test file runs whole in one of them, so its module
# fixtures are shared as in a plain run; most of the slow tests wait on processes of their own.
TEST_WORKERS ?= 2

.PHONY: demo test test-fast lint benchmark notebooks clean

demo: $(VENV)/.demo-installed
	$(PY) -m estimatorch demo $(DEMO_ARGS)

test: lint $(VENV)/.dev-installed
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=15

# The habits CI keeps: ruff (ruff.toml) and mypy (setup.cfg) over estimatorch/, both clean.
lint: $(VENV)/.dev-installed
	$(PY) -m ruff check estimatorch
	$(PY) -m mypy

# Everything but the slow, multi-process and notebook tests: for the edit-run cycle.
test-fast: $(VENV)/.dev-installed
	$(PY) -m pytest -m "not slow and not distributed and not notebook"

benchmark: $(VENV)/.dev-installed
	$(PY) benchmarks/overhead.py

# Run the notebooks and save them with their outputs (after editing one): make notebooks [NB=01_quickstart]
notebooks: $(VENV)/.dev-installed
	$(PY) -m tests.test_notebooks $(NB)

$(PY):
	@echo "Creating $(VENV) (first run only)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.demo-installed: $(PY) setup.cfg setup.py requirements-demo.txt
	@echo "Installing torch and estimatorch into $(VENV) (first run only; quiet, may take a minute)"
	$(PY) -m pip install --quiet -r requirements-demo.txt
	touch $@

$(VENV)/.dev-installed: $(PY) setup.cfg setup.py requirements-dev.txt requirements-streaming.txt
	@echo "Installing torch, estimatorch and the test tools into $(VENV) (first run only; quiet, may take a minute)"
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-streaming.txt
	touch $@ $(VENV)/.demo-installed

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
