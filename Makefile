# onnx-fleet: the two commands that matter are `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test lint bench bench-quick models clean reliability constraints

# constraints.txt: the exact versions CI tested (pip constraints); `make constraints` regenerates it
$(STAMP): pyproject.toml setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,bench]"
	touch $(STAMP)

## constraints: rewrite constraints.txt from this environment (after a deliberate upgrade, once the tests pass)
constraints: $(STAMP)
	$(BIN)/python -m tools.lock_constraints

## demo: whole fleet end to end on a private Redis (no Docker, no Redis needed), then clean shutdown
demo: $(STAMP)
	$(BIN)/fleet demo

## test: unit + integration tests (real redis-server, real celery workers, real ONNX Runtime), in three
## processes on 2 cores (much of the suite waits on subprocesses and events: two processes left the CPUs
## idle a third of the run), each test file whole in one of them, longest file first
## (tests/file_seconds.json: tools/test_order.py)
test: $(STAMP)
	$(BIN)/python -m pytest -n 3 --dist loadfile --no-loadscope-reorder

## lint: ruff + mypy --strict over the packages
lint: $(STAMP)
	$(BIN)/ruff check protocol broker workers producer gateway store tools bench planner tests
	$(BIN)/mypy

## models: build the demo models into ./models
models: $(STAMP)
	$(BIN)/fleet build-model

## bench: the full benchmark table (about 18 minutes on 2 cores) -> docs/benchmarks.md
bench: $(STAMP)
	$(BIN)/fleet bench

bench-quick: $(STAMP)
	$(BIN)/fleet bench --quick

## reliability: the fault matrix (tests/integration/test_faults.py: worker kill/term, Redis restart, stall,
## full AOF disk, network cut, memory limit; real processes, ~2.5 min, root for the last three) -> the
## table in docs/reliability.md, from var/reliability/*.json (rendered even when a test fails; exit = pytest's)
reliability: $(STAMP)
	rm -rf var/reliability
	$(BIN)/python -m pytest -rxs tests/integration/test_faults.py; status=$$?; \
	$(BIN)/python -m bench.fault_table --records var/reliability --doc docs/reliability.md; exit $$status

clean:
	rm -rf $(VENV) models var .pytest_cache .mypy_cache .ruff_cache
