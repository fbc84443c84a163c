"""The plugin's hold on SGLang: the registry and CLI extension points, and every internal used."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

from tests.integrations.sglang.host import host
from tests.load import scaled

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

    from gramcoord.integrations.sglang.backend import SglangBackend
    from gramcoord.integrations.sglang.plugin import register

    h = host()
    register()  # idempotent
    assert GRAMMAR_BACKEND_CHOICES.count("gramcoord") == 1
    assert "gramcoord" in GRAMMAR_BACKEND_REGISTRY
    backend = create_grammar_backend(h.server_args, h.tokenizer, h.vocab_size, h.eos_token_ids)
    try:
        assert isinstance(backend, SglangBackend)
        assert isinstance(backend, BaseGrammarBackend)
        assert backend.grammars.group_size == 1  # no sync group in one process
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


ENTRY_POINT = "gramcoord.integrations.sglang.plugin:register"
_PROBE = """
import sys
from tests.integrations.sglang.torchvision_standin import install
install()
from sglang.srt.plugins import load_plugins
from sglang.srt.constrained.base_grammar_backend import GRAMMAR_BACKEND_REGISTRY
from sglang.srt.arg_groups.choices import GRAMMAR_BACKEND_CHOICES
assert "gramcoord" not in GRAMMAR_BACKEND_REGISTRY
load_plugins()
print("registered" if "gramcoord" in GRAMMAR_BACKEND_REGISTRY
      and "gramcoord" in GRAMMAR_BACKEND_CHOICES else "missing")
"""


def test_sglangs_load_plugins_runs_register(tmp_path) -> None:
    """SGLang's general-plugin entry point group (``sglang.srt.plugins``), which
    ``launch_server``, ``Engine`` and every scheduler process load before
    parsing arguments, runs ``register``. The entry point is declared in a
    temporary distribution here, so the test holds whether or not the
    installed gramcoord declares it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    dist = tmp_path / "gramcoord_probe-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: gramcoord-probe\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(f"[sglang.srt.plugins]\ngramcoord = {ENTRY_POINT}\n")
    root = Path(__file__).resolve().parents[3]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)]),
        "SGLANG_PLUGINS": "gramcoord",
        "OMP_NUM_THREADS": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=scaled(240),
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "registered", out.stderr[-3000:]


def test_the_refusal_hint_names_sglangs_way() -> None:
    from gramcoord.integrations.sglang.backend import UNENFORCED_HINT, sglang_grammar_config
    from gramcoord.rank_worker.errors import SpecError
    from gramcoord.rank_worker.grammars.spec import validate_spec

    unenforced = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    # The server's backend admits it (SGLang's own check and the end check run).
    validate_spec({"json": unenforced}, sglang_grammar_config())
    with pytest.raises(SpecError) as info:
        validate_spec({"json": unenforced}, sglang_grammar_config(reject_ignored_features=True))
    assert info.value.message.endswith(UNENFORCED_HINT)
    assert "sglang_grammar_config(reject_ignored_features=False)" in info.value.message
