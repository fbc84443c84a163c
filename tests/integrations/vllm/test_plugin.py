"""The plugin's hold on vLLM: every internal it touches is still there, as it expects."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.timeout(300)


def test_every_vllm_internal_the_plugin_touches_is_unchanged() -> None:
    from gramcoord.integrations.vllm.plugin import INTERNALS, check_internals

    problems = check_internals()
    assert not problems, "vLLM internals changed: " + "; ".join(problems)
    assert len(INTERNALS) >= 8


def test_register_is_idempotent_and_widens_the_backend_name() -> None:
    from gramcoord.integrations.vllm.plugin import register

    register()
    register()
    from vllm.config.structured_outputs import StructuredOutputsConfig

    config = StructuredOutputsConfig(backend="gramcoord", disable_any_whitespace=True)
    assert config.backend == "gramcoord"
    with pytest.raises(ValueError):
        StructuredOutputsConfig(backend="no-such-backend")


def test_unsupported_vllm_version_is_refused(monkeypatch) -> None:
    import vllm

    from gramcoord.integrations.vllm import plugin

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x"):
        plugin._check_version()


def test_entry_point_is_installed() -> None:
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("gramcoord") == "gramcoord.integrations.vllm.plugin:register"


def test_a_warm_start_imports_what_a_first_structured_request_would() -> None:
    """With a spec store, the front end imports vLLM's validation modules and the
    engine applies one bitmask at start, so that a restarted server's first
    structured request does not import them (a fresh interpreter: nothing of
    it imported before)."""
    code = (
        "import sys, threading\n"
        "from gramcoord.integrations.vllm import plugin\n"
        "names = ('xgrammar.kernels.apply_token_bitmask_inplace_cpu', "
        "*plugin._FIRST_REQUEST_IMPORTS)\n"
        "assert not [n for n in names if n in sys.modules]\n"
        "plugin._warm_apply()\n"
        "plugin._import_first_request_modules()\n"
        "for t in threading.enumerate():\n"
        "    if t.name == 'gramcoord-warm-apply': t.join(120)\n"
        "print(len([n for n in names if n in sys.modules]), len(names))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    got, wanted = out.stdout.split()[-2:]
    assert got == wanted == "4", out.stdout + out.stderr
