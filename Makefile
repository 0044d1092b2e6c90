# The README's two commands: `make run` and `make test`. Each sets everything up first.
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The default run: no GPU tests, no `slow` ones (real-process clusters and failover).
PYTEST_ARGS ?= -m "not slow and not gpu"

.PHONY: run test lint test-all clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvflow serve

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-all: lint
	$(BIN)/python -m pytest -m "not gpu"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
