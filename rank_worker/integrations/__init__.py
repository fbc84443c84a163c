"""Structured output for host engines and libraries that run their own step loop.

Each integration wraps one ``RankSession`` (``gramcoord.rank_worker.session``)
per process and keeps the session's collectives at a point every rank
reaches, never inside a path that runs only when constrained rows are
scheduled.

========================  =======================================================
module                    integration
========================  =======================================================
``hf``                    Hugging Face ``generate`` on one process or on
                          data-parallel ranks (``torchrun``, gloo), e.g. GRPO
                          rollouts: ``GenerateSession`` (``prepare`` before
                          ``generate``, ``finish`` after it) and its
                          ``GrammarLogitsProcessor``. Needs ``transformers``
                          (the ``hf`` extra).
``hf_processor``          the ``hf`` integration's collective-free
                          ``GrammarLogitsProcessor``.
``examples.hf_generate``  runnable ``hf`` example: tiny in-process Qwen2 model,
                          real Qwen2.5 vocabulary, ``python -m`` or
                          ``torchrun -m``.
========================  =======================================================

vLLM and SGLang are served by ``gramcoord.integrations.vllm`` (a vLLM
plugin) and ``gramcoord.integrations.sglang`` (a registered SGLang grammar
backend), inside the real engines, not here.

The modules are not imported here, so ``gramcoord.rank_worker.integrations``
imports without their optional dependencies.
"""
