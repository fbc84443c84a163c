"""Runnable examples of the integrations (``python -m`` or ``torchrun -m``).

- ``hf_generate``: Hugging Face ``generate`` with ``GenerateSession`` on one
  process or on data-parallel ranks; a tiny random-weight Qwen2 model built
  in process and the real Qwen2.5 vocabulary, nothing downloaded.
- ``sglang_scheduler``: a miniature SGLang scheduler loop on
  ``SGLangGrammarManager``, one scheduler per rank (partitioned, or
  ``--replicated``).
"""
