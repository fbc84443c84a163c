"""Runnable examples of the integrations (``python -m`` or ``torchrun -m``).

- ``hf_generate``: Hugging Face ``generate`` with ``GenerateSession`` on one
  process or on data-parallel ranks; a tiny random-weight Qwen2 model built
  in process and the real Qwen2.5 vocabulary, nothing downloaded.
- ``vllm_engine``: a miniature vLLM-shaped engine on the ``vllm_backend``
  adapter, one scheduler per rank.
- ``sglang_scheduler``: a miniature SGLang scheduler loop on
  ``SGLangGrammarManager``, one scheduler per rank (partitioned, or
  ``--replicated``).
"""
