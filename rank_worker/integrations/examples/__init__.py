"""Runnable example of the ``hf`` integration (``python -m`` or ``torchrun -m``).

- ``hf_generate``: Hugging Face ``generate`` with ``GenerateSession`` on one
  process or on data-parallel ranks; a tiny random-weight Qwen2 model built
  in process and the real Qwen2.5 vocabulary, nothing downloaded.
"""
