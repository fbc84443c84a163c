"""Real-SGLang tests: skipped without SGLang unless GRAMCOORD_REQUIRE_SGLANG=1.

SGLang is installed with ``pip install --no-deps sglang==0.5.23`` plus the
pure-Python packages of ``integrations/sglang/requirements-sglang.txt``.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile

if importlib.util.find_spec("sglang") is None:
    if os.environ.get("GRAMCOORD_REQUIRE_SGLANG") == "1":
        raise RuntimeError("GRAMCOORD_REQUIRE_SGLANG=1 but SGLang is not installed")
    # every test module skips itself (pytest.importorskip)
else:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # One folder for every process's saved tokenizer (host.py), the spawned
    # ranks' too: they leave with os._exit, so this session removes it.
    if "GRAMCOORD_SGLANG_TMP" not in os.environ:
        os.environ["GRAMCOORD_SGLANG_TMP"] = tempfile.mkdtemp(prefix="gramcoord-sglang-")
        atexit.register(shutil.rmtree, os.environ["GRAMCOORD_SGLANG_TMP"], ignore_errors=True)
