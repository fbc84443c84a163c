"""The README's two commands must keep pointing at commands that exist."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from gramcoord.launch.cli import _parser

ROOT = Path(__file__).resolve().parents[2]


def _recipe(target: str) -> list[str]:
    text = (ROOT / "Makefile").read_text()
    block = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", text, re.M)
    assert block, f"no {target} target"
    return [line.strip() for line in block.group(1).splitlines()]


def test_make_run_invokes_a_real_cli_command():
    calls = [ln for ln in _recipe("run") if "gramcoord " in ln]
    assert calls, "make run does not call gramcoord"
    for line in calls:
        argv = shlex.split(line.split("gramcoord", 1)[1])
        args, extra = _parser().parse_known_args(argv)
        assert not extra, extra
        if getattr(args, "config", None):
            assert (ROOT / args.config).is_file()


def test_ci_runs_make_test():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
