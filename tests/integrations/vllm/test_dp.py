"""vLLM's own data-parallel mode (DP=2, ``external_launcher``, torchrun): poison shared.

A schema that timed out on one replica fails at once on the other, with the
same code and message, without a compile (``integrations.vllm.replicas``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.integrations.vllm.dp_driver import POISON_MARK
from tests.integrations.vllm.tiny_model import vllm_cpu_shm
from tests.load import scaled
from tests.procs import torchrun_command

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def dp_run(tiny_model, tmp_path_factory) -> dict[int, dict[str, Any]]:
    out = tmp_path_factory.mktemp("dp")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = torchrun_command(
        Path(__file__).with_name("dp_driver.py"),
        str(tiny_model),
        str(out),
        log_dir=out / "torchrun",
    )
    with vllm_cpu_shm():
        proc = subprocess.run(
            cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=scaled(800)
        )
    logs = "".join(p.read_text(errors="replace")[-4000:] for p in out.rglob("std*.log"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:] + logs
    return {r: json.loads((out / f"replica{r}.json").read_text()) for r in (0, 1)}


def test_a_timed_out_schema_fails_at_once_on_the_other_replica(dp_run) -> None:
    learnt, met = dp_run[0], dp_run[1]
    assert learnt["learn"]["reason"] == "error" and learnt["learn"]["tokens"] == 0
    code, message = learnt["_refused"]["learn"]
    assert code == "grammar_timeout", message
    # Replica 1 never compiled the schema, and failed it with replica 0's code and text.
    assert met["meet"]["reason"] == "error" and met["meet"]["tokens"] == 0
    met_code, met_message = met["_refused"]["meet"]
    assert met_code == code, met_message
    assert met_message.startswith(
        "cached verdict, no compile ran for this request: an earlier compile of this "
        f"grammar failed: {message}; a retry compiles it again in about "
    ), met_message
    assert "--additional-config gramcoord.grammar.poison_ttl_s=" in met_message
    assert not any(POISON_MARK in text for text in met["_compiled"]), met["_compiled"]
    # Each replica compiled the plain schema once (its first plain request).
    assert len(met["_compiled"]) == len(learnt["_compiled"]) == 1


def test_the_replicas_other_requests_run_on(dp_run) -> None:
    for rank, rids in ((0, ("filler0", "beside-meet")), (1, ("beside-learn", "filler1"))):
        for rid in rids:
            assert dp_run[rank][rid]["reason"] in ("stop", "length"), (rank, dp_run[rank])
