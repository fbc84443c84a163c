"""YAML configs: typed sections, field paths in errors, --set overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from gramcoord.launch.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_configs_load():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(path)


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "needle"),
    [
        pytest.param("parallel: {dp: 0}", [], "$.parallel.dp", id="dp-zero"),
        pytest.param(
            "grammar: {compile_timeout_s: -1}",
            [],
            "$.grammar.compile_timeout_s",
            id="negative-timeout",
        ),
        pytest.param("grammar: {compile_mode: fast}", [], "$.grammar.compile_mode", id="bad-enum"),
        pytest.param("grammer: {}", [], "grammer", id="unknown-section"),
        pytest.param("tokenizer: {name: hf}", [], "tokenizer.path is required", id="cross-field"),
        pytest.param("[1, 2]", [], "top level must be a mapping", id="not-mapping"),
        pytest.param("a: [", [], "not valid YAML", id="bad-yaml"),
        pytest.param("", ["grammar.max_pending=0"], "$.grammar.max_pending", id="override-bad"),
        pytest.param("", ["novalue"], "key=value", id="override-syntax"),
    ],
)
def test_errors_name_the_field(tmp_path, yaml_text, overrides, needle):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert needle in str(info.value)


def test_overrides_apply_typed_values():
    cfg = load_config(
        None,
        [
            "grammar.compile_timeout_s=2.5",
            "parallel.dp=2",
            "launcher=torchrun",
            "grammar.jump_forward=true",
        ],
    )
    assert (
        cfg.grammar.compile_timeout_s == 2.5 and cfg.parallel.dp == 2 and cfg.grammar.jump_forward
    )
