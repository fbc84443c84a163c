"""Real-vLLM tests: skipped without vLLM unless GRAMCOORD_REQUIRE_VLLM=1.

vLLM's CPU environment (``tiny_model.CPU_ENV``) is set before vLLM is imported; the
tiny model is built once per session; engines are shared per backend.
"""

from __future__ import annotations

import atexit
import gc
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gramcoord.benchmarks._vllm_common import ENGINE_KW
from tests.dev_data import schema
from tests.integrations.vllm.tiny_model import (
    COMPILE_DEADLINE,
    CPU_ENV,
    build_tiny_model,
)

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("GRAMCOORD_REQUIRE_VLLM") == "1":
        raise RuntimeError("GRAMCOORD_REQUIRE_VLLM=1 but vLLM is not installed")
    pass  # every test module skips itself (pytest.importorskip)
else:
    # vLLM's compile cache and its engine's ipc sockets (by default loose in
    # /tmp, one per engine) live in one directory, removed when the session ends.
    _CACHE = tempfile.mkdtemp(prefix="gramcoord-vllm-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    os.makedirs(os.path.join(_CACHE, "rpc"))
    for _k, _v in {
        **CPU_ENV,
        "VLLM_CACHE_ROOT": _CACHE,
        "VLLM_RPC_BASE_PATH": os.path.join(_CACHE, "rpc"),
        "VLLM_PLUGINS": "gramcoord",
    }.items():
        os.environ.setdefault(_k, _v)

# A loaded 2-core machine compiles for minutes (tiny_model.COMPILE_DEADLINE).
# Specs containing FAULT_BREAK fail to compile, and those containing
# FAULT_HANG hang in their compile (test_failures.py); no other spec does.
FAULT_BREAK = "gramcoord-fault-break"
FAULT_HANG = "gramcoord-fault-hang"
GRAMCOORD_CONFIG = {
    "gramcoord": {
        "grammar": dict(COMPILE_DEADLINE),
        "faults": {
            "compile_error": {"pattern": FAULT_BREAK, "rank": 0},
            "compile_delay": {"pattern": FAULT_HANG, "rank": 0, "seconds": 900, "times": 0},
        },
    }
}
# Dev schemas that vLLM's xgrammar backend and gramcoord both accept (gramcoord refuses
# in vLLM what xgrammar would not enforce, e.g. Handwritten/pNameFalse's `not`) and
# that compile in well under a second with the Qwen2.5 vocabulary.
FAST_IDS = (
    "Github_trivial/o32735",
    "Github_trivial/o4050",
    "Github_easy/o69751",
    "Github_medium/o79651",
    "Github_medium/o76459",
    "Github_hard/o83745",
    "Github_hard/o41203",
    "calculate_area_59aeb8e9",
    "generate_password_7cc4d",
    "Kubernetes/kb_943_Normalized",
    "Kubernetes/kb_866_Normalized",
    "WashingtonPost/wp_70_Normalized",
    "WashingtonPost/wp_108_Normalized",
    "WashingtonPost/wp_109_Normalized",
    "JsonSchemaStore/jsinspectrc",
    "JsonSchemaStore/importmap",
    "MCPspec/ListToolsRequest",
    "MCPspec/CancelledNotification",
    "MCPspec/ListResourcesResult",
    "Github_easy/o9772",
    "BFCL_simple/BFCL_simple_313",
    "BFCL_simple/BFCL_simple_191",
    "BFCL_multiple/BFCL_multiple_95",
    "BFCL_parallel/BFCL_parallel_76",
)


def fast_schemas() -> list[dict[str, Any]]:
    """The 24 ``FAST_IDS`` schemas, in that order."""
    return [schema(want) for want in FAST_IDS]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build_tiny_model(Path(tempfile.gettempdir()) / "gramcoord-tiny-qwen2")


def make_llm(model: Path, backend: str, **structured: Any) -> Any:
    """An in-process vLLM engine on the tiny model (plugin registered first)."""
    from gramcoord.integrations.vllm.plugin import register

    register()
    from vllm import LLM

    extra = {"additional_config": GRAMCOORD_CONFIG} if backend == "gramcoord" else {}
    return LLM(
        str(model),
        structured_outputs_config={"backend": backend, **structured},
        **extra,
        **ENGINE_KW,
    )


def engine_backend(llm: Any) -> Any:
    """The structured-output backend inside an in-process engine (None before use)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.structured_output_manager.backend


class EngineSlot:
    """At most one live in-process engine: vLLM's parallel state is per process,
    and shutting one engine down tears it down under any other."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.key: tuple[str, bool] | None = None
        self.llm: Any = None

    def get(self, backend: str, compact: bool = False) -> Any:
        if self.key != (backend, compact):
            self.close()
            extra = {"disable_any_whitespace": True} if compact else {}
            self.llm = make_llm(self.model, backend, **extra)
            self.key = (backend, compact)
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            self.llm = self.key = None
            gc.collect()


@pytest.fixture(scope="session")
def engines(tiny_model: Path) -> Iterator[EngineSlot]:
    slot = EngineSlot(tiny_model)
    yield slot
    slot.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The bench test last: its two child engines then find the model's entry in
    the session's vLLM cache, which the in-process engines filled (an engine
    whose cache lacks it inspects the model in a subprocess that imports vLLM
    again, about 13 CPU-s)."""
    items.sort(key=lambda item: item.path.name == "test_bench_vllm.py")
