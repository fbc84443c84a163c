"""Grammars of one rank: vocabulary, spec validation, compile service, caches, manager."""
