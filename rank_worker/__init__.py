"""One rank's grammars: tokenizer, specs, compile service, manager, masks."""

from gramcoord.rank_worker.config import (
    GrammarConfig,
    ReasoningConfig,
    SpeculativeConfig,
    TokenizerConfig,
    TriggerConfig,
)
from gramcoord.rank_worker.engine.decoder import DecodeResult, GreedyDecoder
from gramcoord.rank_worker.engine.drafter import (
    DRAFTERS,
    Drafter,
    NgramDrafter,
    ReferenceDrafter,
    make_drafter,
)
from gramcoord.rank_worker.engine.replay_model import ReplayModel
from gramcoord.rank_worker.errors import ErrorCode, GrammarError, SpecError, WarningCode
from gramcoord.rank_worker.grammars.caches import CompileCache, PoisonCache, PoisonEntry, PoisonKind
from gramcoord.rank_worker.grammars.compile_service import (
    CompileJob,
    CompileService,
    XGrammarBackend,
)
from gramcoord.rank_worker.grammars.manager import GrammarManager, Outcome
from gramcoord.rank_worker.grammars.spec import (
    GrammarSpec,
    StructuredOutputSpec,
    grammar_key,
    validate_spec,
)
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from gramcoord.rank_worker.masks.bitmask import (
    BitmaskBuilder,
    BuildResult,
    default_fill_threads,
    trim_drafts,
)
from gramcoord.rank_worker.masks.gate import CONSTRAINED_FROM_START, ConstraintBounds, Gate, Phase
from gramcoord.rank_worker.masks.grammar_state import GrammarState, strip_padding
from gramcoord.rank_worker.masks.jump_forward import (
    JumpForward,
    JumpResult,
    JumpStats,
    retokenize_plan,
)
from gramcoord.rank_worker.masks.logits_apply import (
    CudaMaskStaging,
    LogitsMasker,
    RowPlan,
    apply_bitmask_cuda,
    plan_rows,
)
from gramcoord.rank_worker.masks.trigger import TriggerMatcher

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
