"""Multi-node bitmask transport: TP workers on the leader's host (shm) and elsewhere (tcp).

Each test starts torchrun (c10d rendezvous, ``--nnodes 2``) on two simulated
hosts with ``transport: {kind: auto, interface: auto}``, checks from rank 0's
log which mode every reader got, and compares the outputs and mask digests
with the one-process reference run. torchrun numbers the nodes by their
host names, so hostA's ranks come first; the layout puts the TP ranks of one
replica next to each other (rank = (dp*pp + pp)*tp + tp).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from gramcoord.launch.cli import main
from gramcoord.launch.run import compare_runs
from tests.launch.multihost import torchrun_on_hosts
from tests.simulated_hosts import SimulatedHosts, available

OK, WHY = available()
needs_hosts = pytest.mark.skipif(not OK, reason=WHY or "simulated hosts unavailable")
ROOT = Path(__file__).resolve().parents[2]
LIMIT = 8

CONFIG = """\
launcher: external
parallel: {dp: %(dp)d, pp: 1, tp: %(tp)d, requests: replicated}
distributed: {step_timeout_s: 30, nnodes: 2}
transport: {kind: auto, interface: auto}
grammar: {compile_mode: sync, compile_timeout_s: 10}
workload: {path: %(workload)s, limit: %(limit)d}
"""


def _run_two_hosts(tmp_path: Path, capfd, *, dp: int, tp: int, nproc: tuple[int, int]):
    """Run the config on hostA/hostB with ``nproc`` ranks each; returns rank logs by rank."""
    cfg = tmp_path / "cross.yaml"
    workload = ROOT / "configs" / "workload.jsonl"
    cfg.write_text(CONFIG % {"dp": dp, "tp": tp, "workload": workload, "limit": LIMIT})
    out = tmp_path / "cross"
    with SimulatedHosts(2) as hosts:
        torchrun_on_hosts(hosts, cfg, out, nproc)
    ref = tmp_path / "ref"
    one = ["--set", "launcher=inline", "--set", "parallel.dp=1", "--set", "parallel.tp=1"]
    rc = main(["run", str(cfg), "--out", str(ref), *one])
    assert rc == 0, capfd.readouterr()
    diffs, n, rows = compare_runs(out, ref)
    assert diffs == [] and n == LIMIT and rows > 0
    return out


def _channels(out: Path, rank: int) -> list[dict[str, str]]:
    """The ``bitmask channel: {...}`` modes that leader ``rank`` logged."""
    text = (out / "logs" / f"rank{rank}.log").read_text(errors="replace")
    found = re.findall(r"bitmask channel: (\{[^}]*\})", text)
    assert found, f"rank {rank} logged no bitmask channel:\n{text[-3000:]}"
    return [ast.literal_eval(x) for x in found]


# -- unit: the interface setting ---------------------------------------------------------------


def test_config_refuses_a_wildcard_interface():
    import msgspec

    from gramcoord.sync.config import TransportConfig

    assert msgspec.convert({"interface": "auto"}, TransportConfig).interface == "auto"
    assert TransportConfig().interface == "127.0.0.1"
    with pytest.raises(msgspec.ValidationError, match="every interface"):
        msgspec.convert({"interface": "0.0.0.0"}, TransportConfig)


@needs_hosts
@pytest.mark.spawn
@pytest.mark.timeout(60)
def test_auto_interface_on_a_simulated_host_is_its_own_address():
    code = (
        "from gramcoord.sync.control import ControlServer as C;"
        "c = C(run_id='t', interface='auto'); print(c.tcp_endpoint); c.close()"
    )
    with SimulatedHosts(2) as hosts:
        for i in range(2):
            done = hosts.run(i, [sys.executable, "-c", code], cwd=ROOT)
            assert done.returncode == 0, done.stderr
            assert done.stdout.strip().startswith(f"tcp://{hosts.addresses[i]}:"), done.stdout


# -- end to end -----------------------------------------------------------------------------


@needs_hosts
@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_tp_worker_on_the_other_host_reads_over_tcp(tmp_path, capfd):
    out = _run_two_hosts(tmp_path, capfd, dp=1, tp=2, nproc=(1, 1))
    assert _channels(out, 0) == [{"rank1": "tcp"}]


@needs_hosts
@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_tp_pairs_on_one_host_each_read_over_shm(tmp_path, capfd):
    out = _run_two_hosts(tmp_path, capfd, dp=2, tp=2, nproc=(2, 2))
    assert _channels(out, 0) == [{"rank1": "shm"}]  # replica 0 on hostA
    assert _channels(out, 2) == [{"rank3": "shm"}]  # replica 1 on hostB


@needs_hosts
@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_mixed_shm_and_tcp_readers_in_one_tp_group(tmp_path, capfd):
    out = _run_two_hosts(tmp_path, capfd, dp=1, tp=3, nproc=(2, 1))
    assert _channels(out, 0) == [{"rank1": "shm", "rank2": "tcp"}]
