"""Structured output for Hugging Face ``generate``, on one process or on data-parallel ranks.

==============  =============================================================
module          holds
==============  =============================================================
``generate``    ``GenerateSession``: ``prepare`` (every collective, before
                ``generate``), ``finish`` after it; e.g. GRPO rollouts
``processor``   its collective-free ``GrammarLogitsProcessor`` (safe under
                ``synced_gpus``)
``tokenizer``   an offline ``Qwen2Tokenizer`` over the real Qwen2.5
                vocabulary, and prompt encoding
==============  =============================================================

The session's collectives stay at a point every rank reaches, never inside
a path that runs only when constrained rows are scheduled. A runnable
example is ``examples/hf_generate.py`` in the checkout. Needs
``transformers`` (the ``hf`` extra); nothing is imported here.
"""
