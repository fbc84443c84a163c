"""One rank's grammars: tokenizer, specs, compile service, manager, masks."""

from rank_worker.bitmask import BitmaskBuilder, BuildResult, default_fill_threads, trim_drafts
from rank_worker.caches import CompileCache, PoisonCache, PoisonEntry, PoisonKind
from rank_worker.compile_service import CompileJob, CompileService, XGrammarBackend
from rank_worker.config import (
    GrammarConfig,
    ReasoningConfig,
    SpeculativeConfig,
    TokenizerConfig,
    TriggerConfig,
)
from rank_worker.decoder import DecodeResult, GreedyDecoder
from rank_worker.drafter import DRAFTERS, Drafter, NgramDrafter, ReferenceDrafter, make_drafter
from rank_worker.errors import ErrorCode, GrammarError, SpecError, WarningCode
from rank_worker.gate import CONSTRAINED_FROM_START, ConstraintBounds, Gate, Phase
from rank_worker.grammar_state import GrammarState, strip_padding
from rank_worker.jump_forward import JumpForward, JumpResult, JumpStats, retokenize_plan
from rank_worker.logits_apply import (
    CudaMaskStaging,
    LogitsMasker,
    RowPlan,
    apply_bitmask_cuda,
    plan_rows,
)
from rank_worker.manager import GrammarManager, Outcome
from rank_worker.replay_model import ReplayModel
from rank_worker.spec import GrammarSpec, StructuredOutputSpec, grammar_key, validate_spec
from rank_worker.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from rank_worker.trigger import TriggerMatcher

__all__ = [
    "CONSTRAINED_FROM_START",
    "DRAFTERS",
    "BitmaskBuilder",
    "BuildResult",
    "CompileCache",
    "CompileJob",
    "CompileService",
    "ConstraintBounds",
    "CudaMaskStaging",
    "DecodeResult",
    "Drafter",
    "ErrorCode",
    "Gate",
    "GrammarConfig",
    "GrammarError",
    "GrammarManager",
    "GrammarSpec",
    "GrammarState",
    "GreedyDecoder",
    "JumpForward",
    "JumpResult",
    "JumpStats",
    "LogitsMasker",
    "NgramDrafter",
    "Outcome",
    "Phase",
    "PoisonCache",
    "PoisonEntry",
    "PoisonKind",
    "ReasoningConfig",
    "ReferenceDrafter",
    "ReplayModel",
    "RowPlan",
    "SpecError",
    "SpeculativeConfig",
    "StructuredOutputSpec",
    "Tokenizer",
    "TokenizerConfig",
    "TokenizerError",
    "TriggerConfig",
    "TriggerMatcher",
    "WarningCode",
    "XGrammarBackend",
    "apply_bitmask_cuda",
    "default_fill_threads",
    "grammar_key",
    "load_tokenizer",
    "make_drafter",
    "plan_rows",
    "retokenize_plan",
    "strip_padding",
    "trim_drafts",
    "validate_spec",
]
