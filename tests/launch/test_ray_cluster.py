"""A real two-node Ray cluster on simulated hosts: `ray start --head` on host A,
`ray start --address` on host B, then `gramcoord run` with `launcher: ray` and
the cluster's address; the placement group puts one rank on each host, and the
outputs equal the one-process reference."""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from gramcoord.launch.cli import main
from gramcoord.launch.run import compare_runs
from tests import load
from tests.load import scaled
from tests.simulated_hosts import SimulatedHosts, available

OK, WHY = available()
pytestmark = pytest.mark.skipif(not OK, reason=WHY or "simulated hosts unavailable")
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# Token authentication off on every node and the driver alike (Ray >= 2.5x).
BASE_ENV = ["env", "RAY_USAGE_STATS_ENABLED=0", "RAY_AUTH_MODE=disabled", "OMP_NUM_THREADS=1"]


def _env(f: float) -> list[str]:
    """``BASE_ENV`` plus Ray's own liveness deadlines, grown with the load factor
    ``f``: at load 20 a driver ended with Ray's fatal "The program will
    terminate" (GCS health checks: 5 misses of a 10 s check on a quiet
    machine mark a node dead; a GCS client gives up after 60 s)."""
    return [
        *BASE_ENV,
        f"RAY_health_check_timeout_ms={int(10_000 * f)}",
        f"RAY_health_check_period_ms={int(3_000 * f)}",
        f"RAY_health_check_failure_threshold={max(5, int(5 * f))}",
        f"RAY_gcs_rpc_server_reconnect_timeout_s={int(60 * f)}",
    ]


# What `ray start` prints when its node is not registered within Ray's own
# fixed 30 s (ray/_private/node.py: raylet_start_wait_time_s, not settable).
RAY_START_TIMED_OUT = "timed out during startup"


def _ray_start(hosts, host: int, argv: list[str], tries: int = 3):
    """``ray start`` on ``host``, started again (after ``ray stop``) when only
    Ray's fixed start-up wait ran out: at load 20 its raylet and GCS took
    longer than 30 s to start. Any other failure is returned at once."""
    for _ in range(tries):
        r = hosts.run(host, argv, timeout=scaled(120))
        if r.returncode == 0 or RAY_START_TIMED_OUT not in r.stderr:
            return r
        hosts.run(host, [str(BIN / "ray"), "stop", "--force"], timeout=scaled(60))
    return r


# The run's deadlines are the quiet ones scaled by the load (a loaded run
# lost a rank to a fixed 30 s step timeout at load average 28).
CONFIG = """\
launcher: ray
parallel: {dp: 2, pp: 1, tp: 1, requests: replicated}
distributed: {step_timeout_s: %s, run_timeout_s: %s, ray_address: "%s:6379",
              ray_strategy: STRICT_SPREAD}
grammar: {compile_timeout_s: %s}
workload: {path: %s, limit: 8}
"""


def _config(head: str) -> str:
    f = load.factor()
    return CONFIG % (
        load.step_timeout(30, f),
        load.step_timeout(200, f),
        head,
        load.step_timeout(10, f),
        ROOT / "configs" / "workload.jsonl",
    )


def _failures(out: Path) -> str:
    """What the run's ranks said, when it failed (its stdout only names the file)."""
    path = out / "logs" / "failures.log"
    return path.read_text(errors="replace")[-3000:] if path.exists() else "(no failures.log)"


# What Ray's own logs say of lost nodes and workers: a failed run is read
# after the temp dir is gone.
RAY_NEWS = re.compile(r"dead|died|failed|timed? ?out|killed|exit", re.IGNORECASE)


def _ray_news(temp: Path, per_file: int = 15) -> str:
    lines = []
    for log in sorted(temp.glob("*/session_latest/logs/*")):
        if log.name.startswith(("raylet", "gcs_server")) and log.suffix in (".out", ".err"):
            hits = [
                ln for ln in log.read_text(errors="replace").splitlines() if RAY_NEWS.search(ln)
            ]
            lines += [
                f"{log.parent.parent.parent.name}/{log.name}: {ln[:300]}" for ln in hits[-per_file:]
            ]
    return "\n".join(lines)


@pytest.mark.spawn
@pytest.mark.timeout(300)
def test_ray_cluster_spreads_ranks_over_two_hosts(tmp_path, capfd):
    temp = Path(tempfile.mkdtemp(prefix="gcray", dir="/tmp"))  # short: Ray's socket paths
    env = _env(load.factor())
    try:
        with SimulatedHosts(2) as hosts:
            head = hosts.addresses[0]
            cfg = tmp_path / "ray.yaml"
            cfg.write_text(_config(head))
            start = [str(BIN / "ray"), "start", "--num-cpus", "1", "--disable-usage-stats"]
            r = _ray_start(
                hosts, 0,
                [*env, *start, "--head", "--port", "6379", "--node-ip-address", head,
                 "--include-dashboard", "false", "--temp-dir", str(temp / "a")],
            )  # fmt: skip
            assert r.returncode == 0, r.stderr[-2000:]
            r = _ray_start(
                hosts, 1,
                [*env, *start, "--address", f"{head}:6379", "--node-ip-address",
                 hosts.addresses[1], "--temp-dir", str(temp / "b")],
            )  # fmt: skip
            assert r.returncode == 0, r.stderr[-2000:]
            out = tmp_path / "out"
            run = hosts.run(
                0, [*env, str(BIN / "gramcoord"), "run", str(cfg), "--out", str(out)],
                timeout=scaled(240), cwd=ROOT,
            )  # fmt: skip
            if run.returncode != 0:  # pytest.fail: an assertion's message is cut short
                pytest.fail(
                    "\n--- ".join(
                        (
                            f"gramcoord run exited {run.returncode}",
                            f"failures.log:\n{_failures(out)}",
                            f"stdout:\n{run.stdout[-1500:]}",
                            f"stderr:\n{run.stderr[-4000:]}",
                            f"Ray's logs:\n{_ray_news(temp)}",
                        )
                    )
                )
            for i in (0, 1):
                hosts.run(i, [str(BIN / "ray"), "stop", "--force"], timeout=scaled(60))
        placed = {
            m.group(1)
            for rank in (0, 1)
            for m in [re.search(r"on host (\w+)", (out / "logs" / f"rank{rank}.log").read_text())]
            if m
        }
        assert placed == {"hostA", "hostB"}
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    ref = tmp_path / "ref"
    rc = main(
        ["run", str(cfg), "--out", str(ref), "--set", "launcher=inline", "--set", "parallel.dp=1"]
    )
    assert rc == 0, capfd.readouterr()
    diffs, n, rows = compare_runs(out, ref)
    assert diffs == [] and n == 8 and rows > 0
