"""docs/configuration.md is generated from the code and documents every field."""

from __future__ import annotations

from pathlib import Path

from gramcoord.launch.config_doc import COMMAND, page, reference
from tests.load import scaled

ROOT = Path(__file__).resolve().parents[2]


def test_every_config_field_has_a_comment():
    rows = [ln for ln in reference().splitlines() if ln.startswith("| `")]
    assert len(rows) > 50
    undocumented = [ln.split("|")[1].strip() for ln in rows if ln.rstrip().endswith("|  |")]
    assert not undocumented, f"fields without a comment: {undocumented}"


def test_the_committed_page_is_what_the_command_prints():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == page(), (
        f"docs/configuration.md differs from the code's config comments: regenerate it "
        f"from the repository root with `{COMMAND}`"
    )


def test_cli_prints_the_page_and_the_resolved_config(capsys):
    from gramcoord.launch.cli import main

    assert main(["config", "--reference"]) == 0
    out = capsys.readouterr().out
    assert out == page() and reference() in out
    assert main(["config", str(ROOT / "configs" / "local.yaml"), "--set", "parallel.tp=1"]) == 0
    import json

    resolved = json.loads(capsys.readouterr().out)
    assert resolved["parallel"]["dp"] == 2 and resolved["parallel"]["tp"] == 1
    assert main(["config", "--set", "parallel.dp=two"]) == 2


def test_printing_a_config_imports_neither_torch_nor_xgrammar():
    """`gramcoord config` runs where the engines are not installed, and in milliseconds."""
    import subprocess
    import sys

    code = (
        "import contextlib, io, sys\n"
        "from gramcoord.launch.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['config', {str(ROOT / 'configs' / 'local.yaml')!r}]) == 0\n"
        "print(sorted(m for m in ('torch', 'xgrammar', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
