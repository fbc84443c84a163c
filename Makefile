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

# The main job: the configs/local.yaml cluster (dp=2 x tp=2 ranks under
# torchrun) runs configs/workload.jsonl and writes runs/local/.
run: $(STAMP)
	$(BIN)/gramcoord run configs/local.yaml

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache runs
