# The two commands of the README: `make demo` and `make test`. Each sets everything up first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test bench clean

# torch first, alone: the CPU build (an unconstrained resolve could pull the CUDA one). Then the project
# with its test extras (build: grpcio-tools, plot: matplotlib) at the versions of constraints.txt.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/pipespec demo

# two workers (pytest-xdist): the Ray modules on one, one after another, the others beside them (tests/xdist_scheduling.py)
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile

bench: setup
	$(PY) -m experiments.bench_engine --json experiments/results/bench_engine.json

clean:
	rm -rf $(VENV) build dist *.egg-info
