"""One rank's grammars: tokenizer, specs, compile service, manager, masks."""

from gramcoord.rank_worker.config import (
    GrammarConfig,
    ModelConfig,
    ReasoningConfig,
    SamplingConfig,
    SpeculativeConfig,
    TokenizerConfig,
    TriggerConfig,
)
from gramcoord.rank_worker.engine.decoder import DecodeResult, GreedyDecoder
from gramcoord.rank_worker.engine.drafter import (
    DRAFTERS,
    Drafter,
    NgramDrafter,
    ReplayDrafter,
    make_drafter,
)
from gramcoord.rank_worker.engine.models import (
    HFModel,
    LogitsSource,
    ModelRequest,
    SyntheticModel,
    build_tiny_qwen2,
    make_model,
)
from gramcoord.rank_worker.engine.sampler import Sampler
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
    "HFModel",
    "JumpForward",
    "JumpResult",
    "JumpStats",
    "LogitsMasker",
    "LogitsSource",
    "ModelConfig",
    "ModelRequest",
    "NgramDrafter",
    "Outcome",
    "Phase",
    "PoisonCache",
    "PoisonEntry",
    "PoisonKind",
    "ReasoningConfig",
    "ReplayDrafter",
    "RowPlan",
    "Sampler",
    "SamplingConfig",
    "SpecError",
    "SpeculativeConfig",
    "StructuredOutputSpec",
    "SyntheticModel",
    "Tokenizer",
    "TokenizerConfig",
    "TokenizerError",
    "TriggerConfig",
    "TriggerMatcher",
    "WarningCode",
    "XGrammarBackend",
    "apply_bitmask_cuda",
    "build_tiny_qwen2",
    "default_fill_threads",
    "grammar_key",
    "load_tokenizer",
    "make_drafter",
    "make_model",
    "plan_rows",
    "retokenize_plan",
    "strip_padding",
    "trim_drafts",
    "validate_spec",
]
