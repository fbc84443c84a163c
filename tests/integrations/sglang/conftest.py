"""Real-SGLang tests: skipped without SGLang unless GRAMCOORD_REQUIRE_SGLANG=1.

SGLang is installed with ``pip install --no-deps sglang==0.5.23`` plus the
pure-Python packages of ``integrations/sglang/requirements-sglang.txt``.
"""

from __future__ import annotations

import importlib.util
import os

if importlib.util.find_spec("sglang") is None:
    if os.environ.get("GRAMCOORD_REQUIRE_SGLANG") == "1":
        raise RuntimeError("GRAMCOORD_REQUIRE_SGLANG=1 but SGLang is not installed")
    # every test module skips itself (pytest.importorskip)
else:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
