"""One rank's program: grammars, masks, the per-rank session, and gramcoord's own step loop.

========================  ====================================================
subpackage                holds
========================  ====================================================
``grammars``              tokenizer, spec validation, compile service, caches,
                          the grammar manager and its per-step admission
``masks``                 grammar states, bitmask builder, logits apply,
                          jump-forward
``session``               ``StageLeader`` (the per-rank verbs every host
                          calls) and ``RankSession`` (the attach of
                          gramcoord's own engine and its TP workers)
========================  ====================================================

Nothing is imported here: importing a config module (``rank_worker.config``)
does not pull in torch or xgrammar.
"""
