"""The plugin's hold on SGLang: the registry and CLI extension points, and every internal used."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

from tests.integrations.sglang.host import host

pytestmark = pytest.mark.timeout(300)


def test_every_sglang_internal_the_plugin_touches_is_unchanged() -> None:
    from gramcoord.integrations.sglang.plugin import INTERNALS, check_internals

    problems = check_internals()
    assert not problems, "SGLang internals changed: " + "; ".join(problems)
    assert len(INTERNALS) >= 10


def test_sglangs_create_grammar_backend_returns_ours() -> None:
    from sglang.srt.arg_groups.choices import GRAMMAR_BACKEND_CHOICES
    from sglang.srt.constrained.base_grammar_backend import (
        GRAMMAR_BACKEND_REGISTRY,
        BaseGrammarBackend,
        create_grammar_backend,
    )

    from gramcoord.integrations.sglang.backend import GramcoordBackend
    from gramcoord.integrations.sglang.plugin import register

    h = host()
    register()  # idempotent
    assert GRAMMAR_BACKEND_CHOICES.count("gramcoord") == 1
    assert "gramcoord" in GRAMMAR_BACKEND_REGISTRY
    backend = create_grammar_backend(h.server_args, h.tokenizer, h.vocab_size, h.eos_token_ids)
    try:
        assert isinstance(backend, GramcoordBackend)
        assert isinstance(backend, BaseGrammarBackend)
        assert backend.agreement.size == 1  # no sync group in one process
    finally:
        backend.close()


def test_cli_accepts_the_backend_name() -> None:
    from sglang.srt.server_args import ServerArgs

    h = host()
    args = ServerArgs(model_path=h.server_args.model_path, grammar_backend="gramcoord")
    assert args.grammar_backend == "gramcoord"


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        pytest.param("0.5.23", True, id="verified"),
        pytest.param("0.5.30", True, id="same-minor"),
        pytest.param("0.6.0", False, id="next-minor"),
        pytest.param("0.4.9", False, id="older"),
    ],
)
def test_version_check(monkeypatch, version: str, ok: bool) -> None:
    import sglang

    from gramcoord.integrations.sglang import plugin

    monkeypatch.setattr(sglang, "__version__", version)
    if ok:
        plugin._check_version()
    else:
        with pytest.raises(RuntimeError, match=r"supports SGLang 0\.5\.x"):
            plugin._check_version()
