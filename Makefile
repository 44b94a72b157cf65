# Two commands do all setup on a fresh machine: `make train` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pytest-xdist workers. Two on 2 cores: a multi-process test leaves a core idle much of the time (ranks starting,
# waiting at barriers, subprocesses importing torch), and a second worker fills it (docs/testing.md).
# --dist loadfile: a file's tests run on one worker, in order, so its module fixtures (the multi-rank runs) are
# computed once, and its planner checks read the runs its equivalence tests wrote before them.
WORKERS ?= 2
XDIST = -n $(WORKERS) --dist loadfile

.PHONY: setup train test test-fast lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first, pinned: a local CPU wheel on our machines, the CUDA build elsewhere.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,plot,data,wandb]'
	touch $(STAMP)

setup: $(STAMP)

# The demo: a small Llama on the Python standard library's own source, about 5 minutes on 2 CPU cores:
# the planner picks a layout for this machine (calibrated once), it trains on one process per core, then
# compares prediction and measurement and writes runs/small/report.md (meshtrain demo; docs/training.md).
# The demo starts fresh each time (a real run continues with train.resume=true instead).
train: $(STAMP)
	rm -rf runs/small
	$(BIN)/meshtrain demo --config configs/small.yaml --out runs/small

# The whole suite, multi-process equivalence tests included (what CI runs).
test: $(STAMP)
	$(BIN)/ruff check meshtrain tests benchmarks
	$(BIN)/python -m pytest -q $(XDIST) --durations=15

# Quick tier for iteration: no spawned process groups, no training runs.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check meshtrain tests benchmarks

clean:
	rm -rf $(VENV) runs data .pytest_cache
