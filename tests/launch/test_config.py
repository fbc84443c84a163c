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


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "blame", "needle"),
    [
        pytest.param(
            "launcher: slurm",
            [],
            "c.yaml: ",
            "choose one of: external, inline, ray, torchrun",
            id="enum-in-file",
        ),
        pytest.param(
            "",
            ["launcher=slurm"],
            "--set launcher=slurm: ",
            "choose one of: external, inline, ray, torchrun",
            id="enum-in-set",
        ),
        pytest.param(
            "grammar: {compile_timeout_s: 5}",
            ["grammar.compile_timeout_s=oops"],
            "--set grammar.compile_timeout_s=oops: ",
            "$.grammar.compile_timeout_s",
            id="bad-set-value",
        ),
        pytest.param("", ["grammar.nope=1"], "--set grammar.nope=1: ", "nope", id="unknown-set"),
        pytest.param(
            "parallel: {dp: 0}", ["grammar.max_pending=3"], "c.yaml: ", "$.parallel.dp", id="file"
        ),
    ],
)
def test_errors_list_choices_and_blame_their_source(tmp_path, yaml_text, overrides, blame, needle):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    text = str(info.value)
    assert needle in text
    assert text.startswith(blame if blame.startswith("--set") else f"{path}: ")


def test_input_paths_are_taken_from_the_config_file_or_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # The shipped configs name their workload beside themselves.
    shipped = load_config(ROOT / "configs" / "local.yaml")
    assert Path(shipped.workload.path) == ROOT / "configs" / "workload.jsonl"
    soak = load_config(ROOT / "configs" / "soak.yaml")
    assert Path(soak.workload.mix_path).is_file()
    # No config at all: the workload shipped with the package.
    assert Path(load_config(None).workload.path).resolve() == ROOT / "configs" / "workload.jsonl"
    (tmp_path / "cfg").mkdir()
    cfg = tmp_path / "cfg" / "c.yaml"
    cfg.write_text("workload: {path: w.jsonl, mix_path: ../m.jsonl}\noutput: {dir: out}\n")
    got = load_config(cfg)
    assert got.workload.path == str(tmp_path / "cfg" / "w.jsonl")
    assert got.workload.mix_path == str(tmp_path / "m.jsonl")
    # --set is a command-line argument: from the working directory.
    assert load_config(cfg, ["workload.path=x.jsonl"]).workload.path == str(tmp_path / "x.jsonl")
    # Outputs go where the command runs (left relative: taken from the cwd).
    assert got.output.dir == "out"
