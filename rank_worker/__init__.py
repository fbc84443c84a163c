"""One rank's program: grammars, masks, the per-rank session, and gramcoord's own step loop.

========================  ====================================================
subpackage                holds
========================  ====================================================
``grammars``              tokenizer, spec validation, compile service, caches,
                          the grammar manager and its per-step admission
``masks``                 grammar states, bitmask builder, logits apply,
                          jump-forward
``session``               ``RankSession``: the per-rank API engines embed
``engine``                gramcoord's step loop (``run_loop``) and its parts
``integrations``          Hugging Face ``generate``
========================  ====================================================

Nothing is imported here: importing a config module (``rank_worker.config``)
does not pull in torch or xgrammar.
"""
