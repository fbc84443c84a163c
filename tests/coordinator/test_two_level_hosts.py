"""``agreement_levels: host`` wired end to end: torchrun across two simulated hosts.

Four replicated DP ranks, two per host, each under its host's own torchrun
(c10d rendezvous, gloo over the veth link). The runtime learns the hostnames,
every rank agrees in two levels (its log says so), and the outputs equal the
one-process reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gramcoord.launch.cli import main
from gramcoord.launch.run import compare_runs
from tests.launch.multihost import torchrun_on_hosts
from tests.simulated_hosts import SimulatedHosts, available

OK, WHY = available()
pytestmark = pytest.mark.skipif(not OK, reason=WHY or "simulated hosts unavailable")
ROOT = Path(__file__).resolve().parents[2]

# clock_sync_steps 2: with the external launcher compile is sync, so the
# agreement collective runs on clock steps only; make them frequent.
CONFIG = """\
launcher: external
parallel: {dp: 4, pp: 1, tp: 1, requests: replicated}
distributed: {step_timeout_s: 30, nnodes: 2, agreement_levels: host, clock_sync_steps: 2}
grammar: {compile_mode: sync, compile_timeout_s: 10}
workload: {path: %s, limit: 10}
"""


@pytest.mark.spawn
@pytest.mark.timeout(300)
def test_two_level_agreement_across_two_hosts_matches_the_reference(tmp_path, capfd):
    cfg = tmp_path / "four.yaml"
    cfg.write_text(CONFIG % (ROOT / "configs" / "workload.jsonl"))
    out = tmp_path / "four"
    with SimulatedHosts(2) as hosts:
        torchrun_on_hosts(hosts, cfg, out, (2, 2))
    for rank in range(4):
        log = (out / "logs" / f"rank{rank}.log").read_text()
        assert "in two levels over hosts [[0, 1], [2, 3]]" in log, log[-2000:]
    ref = tmp_path / "ref"
    rc = main(
        ["run", str(cfg), "--out", str(ref), "--set", "launcher=inline", "--set", "parallel.dp=1"]
    )
    assert rc == 0, capfd.readouterr()
    diffs, n, rows = compare_runs(out, ref)
    assert diffs == [] and n == 10 and rows > 0
