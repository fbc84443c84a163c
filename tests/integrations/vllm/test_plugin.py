"""The plugin's hold on vLLM: every internal it touches is still there, as it expects."""

from __future__ import annotations

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
