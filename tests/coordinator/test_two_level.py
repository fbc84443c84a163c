"""Two-level agreement (``distributed.agreement_levels: host``): grouping, and flat's decisions.

The layout splits agreement groups by host; ``TwoLevel`` runs them in three
rounds. Threads over fake groups cover placements quickly; a spawned gloo
world whose ranks hold real, different hostnames covers the runtime path
(host-name exchange, level groups, gather and broadcast) end to end.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from gramcoord.coordinator.config import DistributedConfig
from gramcoord.coordinator.coordinator import Coordinator
from gramcoord.coordinator.errors import CoordinatorError, LayoutError
from gramcoord.coordinator.layout import HostLevels, ParallelLayout
from tests import load
from tests.coordinator import two_level_ranks
from tests.coordinator.fakes import TIMEOUT_S, ThreadComm, ThreadHub
from tests.load import scaled
from tests.procs import run_ranks


def replicated(dp, tp=1, pp=1, pp_sync="chain"):
    return ParallelLayout(dp=dp, pp=pp, tp=tp, requests="replicated", pp_sync=pp_sync)


@pytest.mark.parametrize(
    ("layout", "hosts", "blocks"),
    [
        pytest.param(replicated(4), "AABB", ((0, 1), (2, 3)), id="block"),
        pytest.param(replicated(4), "ABAB", ((0, 2), (1, 3)), id="round"),
        pytest.param(replicated(6), "AABBBC", ((0, 1), (2, 3, 4), (5,)), id="uneven"),
        pytest.param(replicated(3, tp=2), "AAAABB", ((0, 2), (4,)), id="tp2-leaders-only"),
        pytest.param(replicated(4), "AAAA", None, id="one-host"),
        pytest.param(replicated(4), "ABCD", None, id="one-per-host"),
        pytest.param(replicated(2, tp=2), "AABB", None, id="tp2-one-leader-per-host"),
        pytest.param(ParallelLayout(dp=4, pp=1, tp=1), "AABB", None, id="partitioned"),
    ],
)
def test_host_levels_split_agreement_groups_by_host(layout, hosts, blocks):
    got = layout.host_levels(tuple(hosts))
    if blocks is None:
        assert got == () and layout.level_groups(tuple(hosts)) == ()
        return
    (levels,) = got
    assert levels.group == layout.agreement_groups()[0]
    assert levels.blocks == blocks
    assert levels.leaders == tuple(b[0] for b in blocks)
    named = layout.level_groups(tuple(hosts))
    assert [g for n, g in named if n == "agreement_host"] == [b for b in blocks if len(b) > 1]
    assert [g for n, g in named if n == "agreement_leaders"] == [levels.leaders]


def test_host_levels_need_one_host_per_rank():
    with pytest.raises(LayoutError, match="3 host names for a world of 4"):
        replicated(4).host_levels(("A", "A", "B"))


def test_from_config_refuses_a_runtime_without_host_names():
    comm = ThreadComm(ThreadHub(), replicated(2), 0)
    comm.hosts = ()
    cfg = DistributedConfig(agreement_levels="host")
    with pytest.raises(CoordinatorError, match="knows no host names"):
        Coordinator.from_config(replicated(2), comm, cfg, max_pending=8)


class LevelComm(ThreadComm):
    """``ThreadComm`` plus the level groups, a rooted gather and a broadcast."""

    def __init__(self, hub, layout, rank, hosts) -> None:
        super().__init__(hub, layout, rank)
        self.hosts = tuple(hosts)
        self._groups.update({n: g for n, g in layout.level_groups(self.hosts) if rank in g})

    def gather(self, group, row, dst, *, operation, step):
        rows = self.all_gather(group, row, operation=operation, step=step)
        return rows if self.rank == dst else None

    def broadcast(self, group, buf, src, *, operation, step):
        rows = self.all_gather(group, buf.ravel(), operation=operation, step=step)
        buf.ravel()[:] = rows[self._groups[group].index(src)]
        return buf


@pytest.mark.parametrize(
    ("layout", "hosts"),
    [
        pytest.param(replicated(4), "AABB", id="block"),
        pytest.param(replicated(5), "ABABA", id="round-uneven"),
        pytest.param(replicated(6), "AABBBC", id="host-of-one"),
        pytest.param(replicated(3, tp=2), "AAAABB", id="tp2"),
    ],
)
def test_two_level_decides_what_flat_decides_threads(layout, hosts):
    ranks = [r for r in range(layout.world_size) if layout.is_decider(r)]
    hub = ThreadHub()
    comms = {r: LevelComm(hub, layout, r, hosts) for r in ranks}
    (levels,) = layout.host_levels(tuple(hosts))
    coords = {r: two_level_ranks.coordinators(layout, comms[r], levels) for r in ranks}
    with ThreadPoolExecutor(len(ranks)) as pool:
        futures = {r: pool.submit(two_level_ranks.run_steps, r, coords[r], 8) for r in ranks}
        decided = {r: f.result(timeout=TIMEOUT_S * 3) for r, f in futures.items()}
    assert all(
        c[f"host/{op}"][0].levels == levels
        for c in coords.values()
        for op in ("all_gather", "all_reduce")
    )
    first = decided[ranks[0]]
    for op in two_level_ranks.OPS:
        assert first[f"host/{op}"] == first[f"flat/{op}"]
        assert any(d[0] and d[1] for d in first[f"flat/{op}"]), "decisions must be non-trivial"
    assert all(d == first for d in decided.values())
    # Both ops admit and fail the same (the clock differs: max vs first member's).
    assert [d[:2] for d in first["flat/all_gather"]] == [d[:2] for d in first["flat/all_reduce"]]


def test_two_level_returns_the_flat_arrays_threads():
    layout, hosts = replicated(5), "ABABA"
    hub = ThreadHub()
    comms = [LevelComm(hub, layout, r, hosts) for r in range(5)]
    (levels,) = layout.host_levels(tuple(hosts))
    from gramcoord.coordinator.two_level import TwoLevel

    def one(r):
        two, row = TwoLevel(comms[r], levels), np.arange(6, dtype=np.int64) * (r + 1) - r
        flat_rows = comms[r].all_gather("agreement", row, operation="t", step=0)
        flat_and = comms[r].all_reduce("agreement", row, "band", operation="t", step=0)
        flat_max = comms[r].all_reduce("agreement", row, "max", operation="t", step=0)
        got_rows = two.all_gather(row, operation="t", step=0).copy()
        got_and = two.all_reduce(row, "band", operation="t", step=0).copy()
        got_max = two.all_reduce(row, "max", operation="t", step=0).copy()
        return (
            np.array_equal(flat_rows, got_rows)
            and np.array_equal(flat_and, got_and)
            and np.array_equal(flat_max, got_max)
        )

    with ThreadPoolExecutor(5) as pool:
        assert all(pool.map(one, range(5), timeout=TIMEOUT_S * 3))


@pytest.mark.spawn
@pytest.mark.timeout(150)
@pytest.mark.skipif(os.geteuid() != 0, reason="per-rank hostnames need a UTS namespace (root)")
def test_two_level_over_real_hostnames_matches_flat():
    world, hosts, steps = 5, "ABABA", 6
    results = run_ranks(
        two_level_ranks.levels_body,
        world,
        args=(hosts, steps),
        timeout=scaled(120),
        env=two_level_ranks.ENV,
    )
    values = [r.value for r in results]
    want = HostLevels((0, 1, 2, 3, 4), ((0, 2, 4), (1, 3)), (0, 1))
    assert all(v["hosts"] == ("hostA", "hostB", "hostA", "hostB", "hostA") for v in values)
    assert all(v["levels"] == want for v in values)
    assert [v["groups"]["agreement_host"] for v in values] == [
        (0, 2, 4), (1, 3), (0, 2, 4), (1, 3), (0, 2, 4)
    ]  # fmt: skip
    assert [v["groups"]["agreement_leaders"] for v in values] == [(0, 1), (0, 1), (), (), ()]
    first = values[0]["decided"]
    assert all(v["decided"] == first for v in values)
    for op in two_level_ranks.OPS:
        assert first[f"host/{op}"] == first[f"flat/{op}"]
        assert len(first[f"host/{op}"]) == steps
        assert any(d[0] and d[1] for d in first[f"flat/{op}"])


@pytest.mark.spawn
@pytest.mark.timeout(150)
@pytest.mark.skipif(os.geteuid() != 0, reason="per-rank hostnames need a UTS namespace (root)")
@pytest.mark.parametrize("victim", [pytest.param(3, id="member"), pytest.param(2, id="leader")])
def test_two_level_survivors_of_a_lost_rank_raise_in_bounded_time(victim):
    f = load.factor()
    hosts, timeout_s = "AABB", load.step_timeout(2.0, f)
    results = run_ranks(
        two_level_ranks.lost_body,
        4,
        args=(hosts, victim, timeout_s),
        timeout=load.scaled(90, f),
        env=two_level_ranks.ENV,
        check=False,
    )
    for r in results:
        if r.rank == victim:
            assert not r.ok
            continue
        assert r.ok, r.traceback
        v = r.value
        assert v["ranks"] is not None, "a survivor stepped on past the loss"
        # Inside the victim's host it is named; elsewhere, the loss shows as
        # that host's leader leaving, which may name nobody.
        if hosts[r.rank] == hosts[victim]:
            assert v["ranks"] == (victim,), v["message"]
        else:
            assert set(v["ranks"]) <= {victim, 2}, v["message"]
        # Bounds the hang; not a speed test.
        assert v["waited_s"] < 2 * timeout_s + load.scaled(1.5, f), v
