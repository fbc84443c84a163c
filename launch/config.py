"""The cluster config: YAML decoded into typed, frozen sections.

Each package owns its section (``gramcoord.rank_worker.config``, ``gramcoord.coordinator.config``,
``gramcoord.sync.config``); this module composes them. A bad field is reported with
its path (``$.grammar.compile_timeout_s``) before any process starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from gramcoord.coordinator.config import DistributedConfig, ParallelConfig
from gramcoord.rank_worker.config import GrammarConfig, SpeculativeConfig, TokenizerConfig
from gramcoord.sync.config import TransportConfig


class ConfigError(ValueError):
    """The config file or an override is invalid; the message names the field."""


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # "synthetic": deterministic pseudo-logits; "hf": a local HF causal LM.
    kind: Literal["synthetic", "hf"] = "synthetic"
    # Local model directory (kind == "hf").
    path: str | None = None
    # Seed of the synthetic logits.
    seed: int = 0


class WorkloadConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # JSONL workload; relative paths are taken from the working directory.
    path: str = "../shared/data/schemas-dev.jsonl"
    # Use at most this many records (0 = all).
    num_requests: int = 0
    # Default max_tokens for records that do not set it.
    max_tokens: int = 256


class OutputConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Directory for outputs.jsonl / summary.json / check.jsonl.
    dir: str = "runs/local"


class ClusterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    # How ranks are started: torchrun, ray, inline (one process) or
    # external (the host program made the process group).
    launcher: Literal["torchrun", "ray", "inline", "external"] = "inline"
    distributed: DistributedConfig = msgspec.field(default_factory=DistributedConfig)
    grammar: GrammarConfig = msgspec.field(default_factory=GrammarConfig)
    speculative: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)
    tokenizer: TokenizerConfig = msgspec.field(default_factory=TokenizerConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    workload: WorkloadConfig = msgspec.field(default_factory=WorkloadConfig)
    output: OutputConfig = msgspec.field(default_factory=OutputConfig)


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one ``a.b.c=value`` override; the value is parsed as YAML."""
    path, sep, raw = assignment.partition("=")
    if not sep or not path.strip():
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    keys = path.strip().split(".")
    node = data
    for k in keys[:-1]:
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {path}: {k!r} is not a section")
        node = child
    try:
        node[keys[-1]] = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {path}: cannot parse {raw!r}: {exc}") from exc


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> ClusterConfig:
    """Read a YAML config (or the defaults), apply overrides, validate.

    Raises
    ------
    ConfigError
        Unreadable YAML, unknown field, wrong type or cross-field conflict;
        the message names the field path.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    for item in overrides:
        apply_override(data, item)
    try:
        return msgspec.convert(data, ClusterConfig)
    except msgspec.ValidationError as exc:
        where = f"{path}: " if path else ""
        raise ConfigError(f"{where}{exc}") from exc
