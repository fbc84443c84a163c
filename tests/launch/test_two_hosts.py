"""Multi-node: torchrun --nnodes 2 (c10d rendezvous) across two simulated hosts.

Every rank runs ``gramcoord.launch.rank_main`` under its host's own torchrun
(the external launcher), gloo over the hosts' veth link; the outputs and
mask digests must equal the one-process reference run.
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

CONFIG = """\
launcher: external
parallel: {dp: 2, pp: 1, tp: 1, requests: replicated}
distributed: {step_timeout_s: 30, nnodes: 2}
grammar: {compile_mode: sync, compile_timeout_s: 10}
workload: {path: %s, limit: 10}
"""


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_torchrun_two_hosts_matches_the_reference(tmp_path, capfd):
    cfg = tmp_path / "two.yaml"
    cfg.write_text(CONFIG % (ROOT / "configs" / "workload.jsonl"))
    out = tmp_path / "two"
    with SimulatedHosts(2) as hosts:
        torchrun_on_hosts(hosts, cfg, out, (1, 1))
    ref = tmp_path / "ref"
    rc = main(
        ["run", str(cfg), "--out", str(ref), "--set", "launcher=inline", "--set", "parallel.dp=1"]
    )
    assert rc == 0, capfd.readouterr()
    diffs, n, rows = compare_runs(out, ref)
    assert diffs == [] and n == 10 and rows > 0
