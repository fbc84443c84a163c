r"""JSON strings without raw control characters, whatever xgrammar's length rule lets in.

xgrammar 0.2.8 (vLLM's pin) and 0.2.9 build a JSON string bounded by
``minLength`` / ``maxLength`` (a string value, a ``propertyNames`` key, a
string in a structural tag's embedded schema) as a quote, a repetition of
one rule, and a quote, where the rule is the character class
``[^"\\\r\n]``. TAB, ``\x01`` and every other control character but CR and
LF pass raw, so a finished output can fail ``json.loads``. Without the
bounds xgrammar builds ``[^\0-\x1f"\\]`` (and escapes).

``SafeStrings`` wraps a ``GrammarCompiler``: a JSON schema or structural
tag whose grammar holds that rule is compiled from xgrammar's own grammar
with the rule's class made ``[^\0-\x1f"\\]``: the same rules, the same
repetition (so the same compile cost), no escape admitted either way, with
the options the host itself passed. Any other grammar is compiled by the
host's own call, unchanged. Every host wraps its compiler where it makes
it: our compile service (``compile_service.XGrammarBackend``), the vLLM
plugin and the SGLang backend. The grammar key does not change: the same
spec always compiles the same way.

Measured against xgrammar as it is, with the Qwen2.5 vocabulary, over the
74 of the 586 compiling dev schemas that have such a string
(``python -m tests.rank_worker.grammars.json_strings_measure``): all 379
dev instances accepted or refused alike; along random walks, the token
masks identical at 13,040 of 13,040 steps but for tokens holding a raw
control character (which differ at 879 of them); compile time 1.02x
xgrammar's at the median. Writing the bounds as an anchored ``pattern``
instead keeps the masks too, but xgrammar unrolls a bounded regex
repetition of up to 128 into its automaton: a median 4.7x the compile
time, 28 schemas over 10x, up to 843x (17 s for one dev schema).
Refusing the schemas refuses 12.6% of them.
"""

from __future__ import annotations

import re
from typing import Any

import xgrammar as xgr

# xgrammar's rule for one character of a length-bounded string, as it
# prints it (0.2.8 and 0.2.9), and the same rule without control characters.
_BLIND_RULE = re.compile(r'^(\S+ ::= \(\()\[\^\\"\\\\\\r\\n\](\)\))$', re.MULTILINE)
_SAFE_CLASS = r'\1[^\\0-\\x1f\\"\\\\]\2'


def safe_grammar_text(grammar: xgr.Grammar) -> str | None:
    """``grammar`` as EBNF with its length-bounded strings' character class made safe,
    or ``None`` when it has no such string (compile it as it is)."""
    text, count = _BLIND_RULE.subn(_SAFE_CLASS, str(grammar))
    return text if count else None


class SafeStrings:
    """A ``GrammarCompiler`` whose JSON grammars keep raw control characters out of strings.

    Every other attribute is the wrapped compiler's. Parameters are the
    wrapped methods' own, so a host's call does not change.
    """

    def __init__(self, compiler: Any) -> None:
        self._compiler = compiler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compiler, name)

    def compile_json_schema(self, schema: Any, **options: Any) -> xgr.CompiledGrammar:
        """``GrammarCompiler.compile_json_schema``, with strings bounded safely."""
        safe = _safe(xgr.Grammar.from_json_schema, schema, **options)
        if safe is None:
            return self._compiler.compile_json_schema(schema, **options)
        return self._compiler.compile_grammar(safe)

    def compile_structural_tag(self, *args: Any, **kwargs: Any) -> xgr.CompiledGrammar:
        """``GrammarCompiler.compile_structural_tag``, with strings bounded safely."""
        safe = _safe(xgr.Grammar.from_structural_tag, *args, **kwargs)
        if safe is None:
            return self._compiler.compile_structural_tag(*args, **kwargs)
        return self._compiler.compile_grammar(safe)


def _safe(build: Any, *args: Any, **kwargs: Any) -> str | None:
    if args and isinstance(args[0], str) and "Length" not in args[0] and "\\u" not in args[0]:
        return None  # no minLength/maxLength, not even spelled with escapes: nothing to do
    try:
        grammar = build(*args, **kwargs)
    except Exception:  # the host's own compile raises its own error, unchanged
        return None
    return safe_grammar_text(grammar)
