"""Shared by the children of ``gramcoord bench vllm``: requests, timers, the engine.

Both children (``_vllm_step``: one in-process engine; ``_vllm_hol``: TP=2
ranks under torchrun) import vLLM, so this module is imported only where
vLLM is installed. Every figure comes from vLLM's real code: the timers
wrap vLLM's own functions in the child's process, and change nothing else.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gramcoord.benchmarks._vllm_model import ENGINE_KW, cpu_env

# The slow schema of the head-of-line run: about 4.4 s to compile with
# xgrammar 0.2.9 (tests/data/schemas-dev.xgrammar-labels.jsonl), accepted by
# vLLM's xgrammar checks and by gramcoord's.
SLOW_ID = "jsonschemabench/JsonSchemaStore/kode-ci-build-1.0.0"
# Fast schemas: labelled compile below this.
FAST_COMPILE_MS = 150.0
# (label, module, attribute path) of what the step breakdown times.
TIMED: tuple[tuple[str, str, str], ...] = (
    ("step", "vllm.v1.engine.core", "EngineCore.step"),
    ("schedule", "vllm.v1.core.sched.scheduler", "Scheduler.schedule"),
    ("forward", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model"),
    ("grammar_bitmask", "vllm.v1.core.sched.scheduler", "Scheduler.get_grammar_bitmask"),
    ("sample_tokens", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens"),
    ("apply_grammar_bitmask", "vllm.v1.worker.gpu_model_runner", "apply_grammar_bitmask"),
    ("update_from_output", "vllm.v1.core.sched.scheduler", "Scheduler.update_from_output"),
)


class Timers:
    """Wall time of each call of the wrapped functions, in ms, per label."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)

    def reset(self) -> None:
        self.samples.clear()

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.samples[label].append((time.perf_counter() - t0) * 1e3)

        setattr(owner, attr, timed)

    def install(self) -> None:
        import importlib

        for label, module, path in TIMED:
            owner: Any = importlib.import_module(module)
            *parents, attr = path.split(".")
            for name in parents:
                owner = getattr(owner, name)
            self.wrap(owner, attr, label)

    def snapshot(self) -> dict[str, list[float]]:
        return {k: list(v) for k, v in self.samples.items()}


def setup_env(cache_root: str | os.PathLike[str] | None) -> None:
    """vLLM's CPU environment; in-process engine. Call before importing vLLM."""
    os.environ.update(cpu_env(cache_root))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def make_llm(model: str, backend: str, **kw: Any) -> Any:
    """``LLM(model)`` with ``backend``; gramcoord registered first (vLLM's offline path)."""
    if backend == "gramcoord":
        import gramcoord.integrations.vllm.plugin as plugin

        plugin.register()
    from vllm import LLM

    return LLM(
        model,
        structured_outputs_config={"backend": backend},
        seed=0,
        **ENGINE_KW,
        **kw,
    )


def _data_dir(data: str | None) -> Path:
    from gramcoord.launch.bench import installed_data_dir
    from gramcoord.launch.workload import dev_data_dir

    return Path(data) if data else (installed_data_dir() or dev_data_dir())


def _accepted(schema: Any) -> bool:
    """Whether vLLM's xgrammar checks and gramcoord's both take ``schema``."""
    from vllm.v1.structured_output.backend_xgrammar import (
        has_xgrammar_unsupported_json_features,
    )

    from gramcoord.rank_worker.config import GrammarConfig
    from gramcoord.rank_worker.grammars.spec import validate_spec

    if not isinstance(schema, dict) or has_xgrammar_unsupported_json_features(schema):
        return False
    try:
        validate_spec({"json": schema}, GrammarConfig())
    except Exception:
        return False
    return True


def dev_schemas(data: str | None, n: int) -> list[dict]:
    """The first ``n`` fast dev schemas both backends accept (the same on every call)."""
    root = _data_dir(data)
    labels = {}
    for line in (root / "schemas-dev.xgrammar-labels.jsonl").read_text().splitlines():
        rec = json.loads(line)
        labels[rec["id"]] = rec
    out = []
    for line in (root / "schemas-dev.jsonl").read_text().splitlines():
        rec = json.loads(line)
        label = labels.get(rec["id"], {})
        fast = label.get("status") == "ok" and (label.get("compile_ms") or 1e9) < FAST_COMPILE_MS
        if fast and _accepted(rec["schema"]):
            out.append(rec["schema"])
        if len(out) == n:
            break
    return out


def slow_schema(data: str | None, round_no: int) -> dict:
    """The slow schema, made a new grammar per round (no cache hit on either side)."""
    root = _data_dir(data)
    for line in (root / "schemas-dev.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["id"] == SLOW_ID:
            schema = dict(rec["schema"])
            props = dict(schema.get("properties") or {})
            props[f"round_{round_no}"] = {"type": "integer"}
            schema["properties"] = props
            return schema
    raise SystemExit(f"{SLOW_ID} is not in {root}/schemas-dev.jsonl")


def params(schema: dict | None, max_tokens: int) -> Any:
    """Greedy, ``max_tokens`` tokens exactly (ignore_eos), JSON-constrained when given."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(json=schema) if schema is not None else None
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=so
    )


def timed_call(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3
