"""Run the per-rank program on simulated hosts under each host's own torchrun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.simulated_hosts import SimulatedHosts

ROOT = Path(__file__).resolve().parents[2]


def torchrun_on_hosts(
    hosts: SimulatedHosts, cfg: Path, out: Path, nproc: tuple[int, ...], *, timeout: float = 200
) -> None:
    """``torch.distributed.run --nnodes N`` (c10d at the first host) on every host; asserts rc 0."""
    procs = []
    for node, n in enumerate(nproc):
        argv = [
            "env", "GLOO_SOCKET_IFNAME=eth0", "OMP_NUM_THREADS=1",
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(len(nproc)), "--nproc-per-node", str(n),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.names[0]}:29400",
            "--log-dir", f"{out}.torchrun{node}",
            "-m", "gramcoord.launch.rank_main", str(cfg), "--out", str(out),
        ]  # fmt: skip
        procs.append(
            hosts.popen(node, argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    logs = [p.communicate(timeout=timeout)[0].decode(errors="replace") for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), "\n".join(x[-3000:] for x in logs)
