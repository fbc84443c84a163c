"""TP=2 under ``external_launcher`` (torchrun): async compile, same admissions on every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.integrations.vllm.conftest import fast_schemas, schema
from tests.integrations.vllm.test_engine import PROMPT, _params, _run
from tests.integrations.vllm.tiny_model import free_port

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[3]
# Compiles for seconds with the Qwen2.5 vocabulary; the driver also holds its
# compile until the fast requests have finished (or 240 s passed), so that
# the engine's first-step warm-up (inductor compiles xgrammar's CPU mask
# kernel, about 12 s here) cannot hide a held-up fast request.
SLOW_ID = "kode-ci-build-1.0"
SLOW_MARK = "app-center-release"  # in the slow schema's text only
FAULT = {
    "type": "object",
    "properties": {"fault_me": {"type": "integer"}},
    "required": ["fault_me"],
}


def _requests() -> list[list[dict[str, Any]]]:
    fast = fast_schemas()
    first = [{"id": "slow", "schema": schema(SLOW_ID), "max_tokens": 16}]
    first += [{"id": f"fast{i}", "schema": fast[i], "max_tokens": 16} for i in range(6)]
    second = [{"id": f"after{i}", "schema": fast[6 + i], "max_tokens": 8} for i in range(3)]
    second.insert(1, {"id": "fault", "schema": FAULT, "max_tokens": 8})
    for batch in (first, second):
        for r in batch:
            r["prompt"] = PROMPT
    return [first, second]


@pytest.fixture(scope="module")
def tp_out(tiny_model, tmp_path_factory) -> Path:
    """The directory of one torchrun TP=2 run's per-rank results."""
    out = tmp_path_factory.mktemp("tp")
    requests = out / "requests.json"
    requests.write_text(json.dumps(_requests()))
    env = {
        **os.environ,
        "FAIL_MARK": "1:fault_me",
        "GATE_MARK": SLOW_MARK,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "--log-dir",
        str(out / "torchrun"),
        str(Path(__file__).with_name("tp_driver.py")),
        str(tiny_model),
        str(requests),
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return out


@pytest.fixture(scope="module")
def tp_run(tp_out) -> dict[int, dict[str, Any]]:
    return {r: json.loads((tp_out / f"rank{r}.json").read_text()) for r in (0, 1)}


@pytest.fixture(scope="module")
def tp_times(tp_out) -> dict[int, dict[str, float]]:
    return {r: json.loads((tp_out / f"rank{r}.times.json").read_text()) for r in (0, 1)}


def test_both_ranks_agree_and_keep_compiles_async(tp_run) -> None:
    r0, r1 = tp_run[0], tp_run[1]
    assert r0 == r1  # tokens, finish reasons and the step each request finished in
    stats = r0["_stats"]
    assert stats["group_size"] == 2 and stats["async"] and stats["num_live"] == 0
    assert stats["collectives"] > 0
    fast = [r0[f"fast{i}"] for i in range(6)]
    assert all(f["reason"] in ("stop", "length") for f in fast)
    assert r0["slow"]["reason"] in ("stop", "length")


def test_the_slow_compile_holds_nobody_up(tp_run, tp_times) -> None:
    """The fast requests finish while the slow compile is still held (no rank waits on it)."""
    for rank in (0, 1):
        assert not tp_times[rank]["gate_timed_out"], tp_times[rank]
    r0 = tp_run[0]
    fast = [r0[f"fast{i}"] for i in range(6)]
    assert max(f["step"] for f in fast) < r0["slow"]["first_step"], r0


def test_a_compile_failing_on_one_rank_fails_on_both(tp_run) -> None:
    for rank in (0, 1):
        got = tp_run[rank]
        assert got["fault"]["reason"] == "error"
        assert got["fault"]["tokens"] == []
        assert all(got[f"after{i}"]["reason"] in ("stop", "length") for i in range(3))


def test_tp_outputs_equal_the_one_process_run(tp_run, engines) -> None:
    llm = engines.get("gramcoord")
    batches = _requests()
    for batch in batches:
        kept = [r for r in batch if r["id"] != "fault"]
        got = _run(llm, [_params(r["schema"], max_tokens=r["max_tokens"]) for r in kept])
        for r, (tokens, reason) in zip(kept, got):
            assert tp_run[0][r["id"]]["tokens"] == tokens, r["id"]
            assert tp_run[0][r["id"]]["reason"] == reason, r["id"]
