"""The cluster config: YAML decoded into typed, frozen sections.

Each package owns its section (``gramcoord.rank_worker.config``, ``gramcoord.coordinator.config``,
``gramcoord.sync.config``); this module composes them. A bad field is reported with
its path (``$.grammar.compile_timeout_s``) before any process starts.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml
from msgspec import Meta

from gramcoord.coordinator.config import DistributedConfig, ParallelConfig
from gramcoord.rank_worker.config import (
    FaultsConfig,
    GrammarConfig,
    ModelConfig,
    SamplingConfig,
    SchedulerConfig,
    SpeculativeConfig,
    TokenizerConfig,
)
from gramcoord.sync.config import TransportConfig


class ConfigError(ValueError):
    """The config file or an override is invalid; the message names the field."""


class WorkloadConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # JSONL workload (vLLM-style records, or the dev-data records as they
    # are). Empty = the one shipped with gramcoord (configs/workload.jsonl of
    # the package). A relative path in a config file is taken from the
    # file's folder; one given with --set, from the working directory.
    path: str = ""
    # Use at most this many records (0 = all).
    limit: Annotated[int, Meta(ge=0)] = 0
    # "all": every request arrives at step 0. "per_step": ``per_step``
    # requests arrive at each step, in file order.
    arrival: Literal["all", "per_step"] = "all"
    # Arrivals per step when arrival is "per_step".
    per_step: Annotated[int, Meta(ge=1)] = 4
    # Read the file this many times (ids get a "#pass" suffix): a soak.
    repeat: Annotated[int, Meta(ge=1)] = 1
    # A second JSONL (.jsonl.gz too) mixed into the stream, cycled: e.g. the
    # hostile corpus. Empty = none. Relative paths as for path.
    mix_path: str = ""
    # One mix_path record after every mix_every - 1 records of path.
    mix_every: Annotated[int, Meta(ge=2)] = 10
    # max_tokens for records that do not set one.
    max_tokens: Annotated[int, Meta(ge=1)] = 256

    @property
    def arrivals_per_step(self) -> int:
        """Arrivals per step, 0 meaning all at once."""
        return self.per_step if self.arrival == "per_step" else 0


class OutputConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Directory for outputs.jsonl, summary.json, digests.jsonl and logs/; a
    # relative path is taken from the working directory (outputs go where
    # the command runs, wherever the config file is).
    dir: str = "runs/local"
    # Seconds between fsyncs of the journal (journal/ in dir): each finished
    # request's line is written as it finishes (it survives a kill of the
    # process at once) and fsynced in the background this often (a machine
    # crash loses at most that long); 0 fsyncs every line on the step.
    fsync_s: Annotated[float, Meta(ge=0, le=60)] = 0.2
    # Write the journal at all. false: outputs.jsonl only at the end, and
    # nothing for --resume or distributed.max_restarts to resume from.
    journal: bool = True


class ClusterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # The rank grid {dp, pp, tp}, request streams (partitioned | replicated)
    # and how later stages learn stage 0's decision (pp_sync).
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    # How ranks are started: torchrun, ray, inline (one process, the
    # reference) or external (the host started the ranks and made the
    # process group; compile is forced sync).
    launcher: Literal["torchrun", "ray", "inline", "external"] = "inline"
    distributed: DistributedConfig = msgspec.field(default_factory=DistributedConfig)
    grammar: GrammarConfig = msgspec.field(default_factory=GrammarConfig)
    speculative: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)
    tokenizer: TokenizerConfig = msgspec.field(default_factory=TokenizerConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    workload: WorkloadConfig = msgspec.field(default_factory=WorkloadConfig)
    output: OutputConfig = msgspec.field(default_factory=OutputConfig)
    faults: FaultsConfig = msgspec.field(default_factory=FaultsConfig)

    def __post_init__(self) -> None:
        world = self.parallel.world_size
        for where, rank in self.faults.ranks().items():
            if rank >= world:
                raise ValueError(f"{where} {rank} is not a rank of a world of {world}")
        if self.parallel.tp_followers != "none":
            raise ValueError(
                "parallel.tp_followers is for engines whose TP ranks run schedulers of their "
                "own (see docs/embedding.md); gramcoord's step loop needs 'none'"
            )
        if self.distributed.poison_exchange != "step":
            raise ValueError(
                "distributed.poison_exchange 'host' is for engines that call "
                "exchange_poison() at their own sync points; gramcoord's step loop needs 'step'"
            )
        if self.distributed.max_restarts and not self.output.journal:
            raise ValueError(
                "distributed.max_restarts resumes from the journal; it needs output.journal true"
            )
        if self.distributed.max_restarts and self.launcher != "torchrun":
            raise ValueError(
                f"distributed.max_restarts restarts through torch's elastic agent; launcher "
                f"{self.launcher!r} does not restart (use torchrun, or --resume after a failure)"
            )
        if self.launcher == "inline" and world != 1:
            raise ValueError(
                f"launcher 'inline' runs one process, but parallel is dp={self.parallel.dp} "
                f"pp={self.parallel.pp} tp={self.parallel.tp}; use torchrun or ray"
            )


# NOTE: the configs folder sits beside this package's folder both in a
# checkout (configs/, launch/) and installed (gramcoord/configs/,
# gramcoord/launch/): pyproject.toml ships it as gramcoord.configs.
SHIPPED_WORKLOAD = Path(__file__).resolve().parents[1] / "configs" / "workload.jsonl"
# Config fields that hold input paths (resolved as WorkloadConfig.path says).
_INPUT_PATHS = (("workload", "path"), ("workload", "mix_path"))


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


def _resolve_inputs(data: dict[str, Any], base: Path) -> None:
    """Relative input paths in ``data`` become paths under ``base``."""
    for section, key in _INPUT_PATHS:
        node = data.get(section)
        value = node.get(key) if isinstance(node, dict) else None
        if isinstance(value, str) and value and not Path(value).is_absolute():
            node[key] = os.path.normpath(base / value)


def _choices(field_path: list[str]) -> tuple[Any, ...] | None:
    """The values a ``Literal`` field at ``field_path`` accepts, if it is one."""
    info: Any = msgspec.inspect.type_info(ClusterConfig)
    for name in field_path:
        fields = {f.name: f.type for f in getattr(info, "fields", ())}
        if name not in fields:
            return None
        info = fields[name]
    return tuple(info.values) if isinstance(info, msgspec.inspect.LiteralType) else None


def _explain(exc: msgspec.ValidationError, path: Path | None, overrides: list[str]) -> str:
    """The error, its choices if it is an enum, blamed on a --set or the file."""
    text = str(exc)
    what, sep, where = text.partition(" - at `")
    field = where.rstrip("`")[2:].split(".") if sep and where.startswith("$.") else []
    unknown = re.match(r"Object contains unknown field `(.*)`", what)
    if unknown:
        field.append(unknown.group(1))
    choices = _choices(field) if what.startswith("Invalid enum value") else None
    if choices:
        text += f"; choose one of: {', '.join(str(c) for c in choices)}"
    dotted = ".".join(field)
    for item in reversed(overrides):
        key = item.partition("=")[0].strip()
        if dotted and (dotted == key or dotted.startswith(key + ".")):
            return f"--set {item}: {text}"
    return f"{path}: {text}" if path is not None else text


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> ClusterConfig:
    """Read a YAML config (or the defaults), apply overrides, validate.

    Relative input paths (``workload.path``, ``workload.mix_path``) in the
    file are taken from its folder, those given with ``--set`` from the
    working directory; both come back absolute. An empty ``workload.path``
    becomes the shipped workload.

    Raises
    ------
    ConfigError
        Unreadable YAML, unknown field, wrong type or cross-field conflict;
        the message names the field path (an enum's choices too) and blames
        the ``--set`` that set it, or the file.
    """
    data: dict[str, Any] = {}
    file = Path(path) if path is not None else None
    if file is not None:
        try:
            text = file.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        _resolve_inputs(data, file.resolve().parent)
    for item in overrides:
        apply_override(data, item)
    _resolve_inputs(data, Path.cwd())
    try:
        config = msgspec.convert(data, ClusterConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc, file, list(overrides))) from exc
    if not config.workload.path:
        workload = msgspec.structs.replace(config.workload, path=str(SHIPPED_WORKLOAD))
        config = msgspec.structs.replace(config, workload=workload)
    return config
