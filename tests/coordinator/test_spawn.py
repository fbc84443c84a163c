"""Real multi-process runs over gloo: agreement, PP chain, shared poison, lost peers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from gramcoord.coordinator.status import PendingState
from tests import load
from tests.coordinator import light_ranks, ranks
from tests.load import scaled
from tests.procs import free_port, run_procs, run_ranks

pytestmark = [pytest.mark.spawn, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
A, B, C, D = (s["regex"] for s in ranks.SPECS)


def values(results):
    return [r.value for r in results]


def test_two_rank_agreement_with_per_rank_compile_delays():
    delays = {0: {B: 0.4}, 1: {A: 0.4, C: 2.0}}  # C times out on rank 1 only
    r0, r1 = values(run_ranks(ranks.agreement_body, 2, args=(delays,), timeout=100))
    assert r0["history"] == r1["history"]
    assert r0["outcomes"] == r1["outcomes"]
    # Every admitted request was ready on both ranks in that step's reports.
    for i, (_step, ready, _failed) in enumerate(r0["history"]):
        for seq in ready:
            assert r0["reported"][i][seq] == r1["reported"][i][seq] == PendingState.READY
    # A (slow on rank 1) and B (slow on rank 0) waited for the slower rank.
    admitted_at = {seq: step for step, ready, _ in r0["history"] for seq in ready}
    first_ready_0 = min(i for i, rep in enumerate(r0["reported"]) if rep.get(0) == 1) + 1
    assert admitted_at[0] > first_ready_0
    # C: failed everywhere with grammar_timeout and poisoned on both ranks,
    # though rank 0's own compile of it succeeded.
    assert ("r2", "failed", "grammar_timeout") in r0["outcomes"]
    assert any(rep.get(2) == PendingState.READY for rep in r0["reported"])
    key_c = ranks._key(ranks.SPECS[2])
    assert r0["poisoned"][key_c] and r1["poisoned"][key_c]
    assert sum(r0["poisoned"].values()) == 1
    assert r0["agreed_ms"] == r1["agreed_ms"] > 0


def test_pipeline_three_stages_follow_stage0():
    delays = {0: {B: 0.2}, 1: {A: 0.25}, 2: {D: 1.5}}  # D misses stage 2's wait
    steps = 30
    s0, s1, s2 = values(run_ranks(ranks.pipeline_body, 3, args=(delays, steps), timeout=100))
    assert [h[0] for h in s0["history"]] == list(range(1, steps + 1))
    assert s0["history"] == s1["history"] == s2["history"]
    assert not s0["follower"] and s1["follower"] and s2["follower"]
    admitted0 = {o[0] for o in s0["outcomes"] if o[1] == "admitted"}
    assert admitted0 == {"r0", "r1", "r2", "r3"}
    assert s1["outcomes"] == s0["outcomes"]
    assert ("r3", "failed", "grammar_stage_timeout") in s2["outcomes"]
    assert {o[0] for o in s2["outcomes"] if o[1] == "admitted"} == {"r0", "r1", "r2"}


def test_shared_poison_across_dp2():
    steps, re_add = 45, 40
    r0, r1 = values(run_ranks(ranks.poison_body, 2, args=(steps, re_add), timeout=100))
    assert ("slow-1", "failed", "grammar_timeout", "miss") in r0["outcomes"]
    # Replica 1 fails its own copy as soon as the key is shared, before its
    # 3 s compile finishes, and a repeat fails at once with no compile.
    assert ("slow-1", "failed", "grammar_timeout", "miss") in r1["outcomes"]
    assert ("slow-again", "failed", "grammar_timeout", "poisoned") in r1["outcomes"]
    assert r1["compiles_of_slow"] == 1
    # Shared on the same steps everywhere. A key that also fails on the other
    # replica before the first report settles (poison_lag_steps) is reported
    # by both: once per replica at most.
    assert r0["shared_at"] == r1["shared_at"] and 1 <= len(r0["shared_at"]) <= 2
    assert r0["poison_exchanges"] == r1["poison_exchanges"] == len(r0["shared_at"])
    assert r0["agreed_ms"] == r1["agreed_ms"]


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


@pytest.mark.parametrize(
    ("layout_kw", "victim", "how", "operation"),
    [
        pytest.param(
            dict(dp=3, pp=1, tp=1, requests="replicated"), 2, "sigkill", "agreement", id="dp3-kill"
        ),
        pytest.param(
            dict(dp=2, pp=1, tp=1, requests="replicated"), 1, "hang", "agreement", id="dp2-hang"
        ),
        pytest.param(dict(dp=1, pp=3, tp=1), 1, "sigkill", "pp_chain", id="pp3-kill-middle"),
    ],
)
def test_lost_peer_raises_within_the_step_timeout(tmp_path, layout_kw, victim, how, operation):
    f = load.factor()
    timeout_s = load.step_timeout(2.0, f)
    world = layout_kw["dp"] * layout_kw["pp"]
    before = _shm_entries()
    results = run_ranks(
        light_ranks.lost_peer_body,
        world,
        args=(layout_kw, victim, how, timeout_s, str(tmp_path)),
        timeout=load.scaled(60, f),
        check=False,
    )
    for r in results:
        if r.rank == victim:
            assert (not r.ok) if how == "sigkill" else r.value == {"hung": True}
            continue
        assert r.ok, r.traceback
        v = r.value
        assert v["error"] == "PeerLostError", v
        assert v["ranks"] == (victim,), v["message"]
        assert v["operation"].startswith(operation)
        assert f"rank {victim} lost" in v["message"]
        # Bounds the hang (the roll call ends with the step timeout); not a speed test.
        assert v["waited_s"] < timeout_s + load.scaled(1.0, f)
        assert v["closed"]
    pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(world)]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    leaked = [n for n in _shm_entries() - before if any(str(p) in n for p in pids)]
    assert leaked == []


def test_external_launcher_under_torch_distributed_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--nnodes=1",
        f"--master_port={free_port()}",
        f"--log-dir={tmp_path / 'torchrun'}",
        str(Path(__file__).with_name("external_main.py")),
        str(tmp_path),
    ]
    proc = subprocess.run(
        cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=scaled(100)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = [msgspec.json.decode((tmp_path / f"rank{r}.json").read_bytes()) for r in (0, 1)]
    assert out[0]["history"] == out[1]["history"]
    assert out[0]["layout"] == [2, 1, 1]
    assert out[0]["compile_mode"] == "sync" and out[0]["collectives"] == 0
    assert out[0]["outcomes"] == out[1]["outcomes"]
    assert {o[1] for o in out[0]["outcomes"]} == {"admitted", "failed"}
    assert "compile_mode forced to 'sync'" in proc.stderr


def test_a_peer_late_to_the_control_groups_is_slow_not_lost():
    # Creating the groups waits the start-up deadline: a rank still importing
    # or loading its vocabulary (seconds on a loaded machine) is not lost.
    results = values(run_ranks(light_ranks.late_peer_body, 2, args=(3.0,), timeout=120))
    assert results[0] == results[1] and results[0]


def test_a_peer_that_never_comes_is_named_at_start_up():
    results = values(run_ranks(light_ranks.absent_peer_body, 2, timeout=120))
    assert results[1] is None
    assert results[0]["ranks"] == (1,) and results[0]["operation"] == "start-up"
    assert "rank 1 lost during 'start-up'" in results[0]["message"]


def test_runtime_start_owns_and_releases_the_world():
    port = free_port()
    results = values(run_procs(light_ranks.own_world_body, 2, args=(port,), timeout=60))
    for v in results:
        assert v == dict(first=(), second=(0,), initialized=False)
