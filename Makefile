# gramcoord: `make run` runs the main job, `make test` runs ruff and pytest.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch first, pinned: here it is a CPU wheel on local disk; any other spec
# pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: run test lint venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

# The main job. Until `gramcoord run` exists (launch issue), it compiles every
# spec of configs/local.yaml's workload and writes one line per record.
run: $(STAMP)
	mkdir -p runs/local
	$(BIN)/gramcoord check --config configs/local.yaml --out runs/local/check.jsonl

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
