"""One rank's grammars: tokenizer, spec validation, compile service, manager."""

from rank_worker.caches import CompileCache, PoisonCache, PoisonEntry, PoisonKind
from rank_worker.compile_service import CompileJob, CompileService, XGrammarBackend
from rank_worker.config import (
    GrammarConfig,
    ReasoningConfig,
    SpeculativeConfig,
    TokenizerConfig,
    TriggerConfig,
)
from rank_worker.errors import ErrorCode, GrammarError, SpecError, WarningCode
from rank_worker.manager import GrammarManager, Outcome
from rank_worker.spec import GrammarSpec, StructuredOutputSpec, grammar_key, validate_spec
from rank_worker.tokenizer import Tokenizer, TokenizerError, load_tokenizer

__all__ = [
    "CompileCache",
    "CompileJob",
    "CompileService",
    "ErrorCode",
    "GrammarConfig",
    "GrammarError",
    "GrammarManager",
    "GrammarSpec",
    "Outcome",
    "PoisonCache",
    "PoisonEntry",
    "PoisonKind",
    "ReasoningConfig",
    "SpecError",
    "SpeculativeConfig",
    "StructuredOutputSpec",
    "Tokenizer",
    "TokenizerConfig",
    "TokenizerError",
    "TriggerConfig",
    "WarningCode",
    "XGrammarBackend",
    "grammar_key",
    "load_tokenizer",
    "validate_spec",
]
