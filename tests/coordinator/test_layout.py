"""ParallelLayout: coordinates, roles, groups, and the errors that name valid values."""

from __future__ import annotations

import itertools

import pytest

from gramcoord.coordinator.config import ParallelConfig
from gramcoord.coordinator.errors import LayoutError
from gramcoord.coordinator.layout import Coords, ParallelLayout


def layout(dp, pp, tp, requests="partitioned", pp_sync="chain"):
    return ParallelLayout(dp=dp, pp=pp, tp=tp, requests=requests, pp_sync=pp_sync)


@pytest.mark.parametrize(
    ("dims", "rank", "coords"),
    [
        pytest.param((1, 1, 1), 0, (0, 0, 0), id="single"),
        pytest.param((2, 1, 1), 1, (1, 0, 0), id="dp2"),
        pytest.param((1, 3, 1), 2, (0, 2, 0), id="pp3"),
        pytest.param((1, 1, 4), 3, (0, 0, 3), id="tp4"),
        pytest.param((2, 2, 2), 5, (1, 0, 1), id="222-r5"),
        pytest.param((2, 2, 2), 6, (1, 1, 0), id="222-r6"),
        pytest.param((3, 2, 2), 11, (2, 1, 1), id="322-last"),
    ],
)
def test_rank_coordinate_round_trip(dims, rank, coords):
    lay = layout(*dims)
    assert lay.coords(rank) == Coords(*coords)
    assert lay.rank_of(*coords) == rank
    assert [lay.rank_of(*lay.coords(r)) for r in range(lay.world_size)] == list(
        range(lay.world_size)
    )


@pytest.mark.parametrize(
    ("dims", "rank", "leader", "worker", "first", "last", "decider_chain"),
    [
        pytest.param((1, 1, 1), 0, True, False, True, True, True, id="single"),
        pytest.param((1, 2, 2), 0, True, False, True, False, True, id="stage0-leader"),
        pytest.param((1, 2, 2), 1, False, True, True, False, False, id="stage0-worker"),
        pytest.param((1, 2, 2), 2, True, False, False, True, False, id="last-leader"),
        pytest.param((1, 2, 2), 3, False, True, False, True, False, id="last-worker"),
        pytest.param((2, 1, 1), 1, True, False, True, True, True, id="dp-leader"),
    ],
)
def test_roles(dims, rank, leader, worker, first, last, decider_chain):
    lay = layout(*dims)
    assert lay.is_stage_leader(rank) is leader
    assert lay.is_tp_worker(rank) is worker
    assert lay.is_first_stage(rank) is first
    assert lay.is_last_stage(rank) is last
    assert lay.is_decider(rank) is decider_chain
    assert layout(*dims, pp_sync="collective").is_decider(rank) is leader


@pytest.mark.parametrize(
    ("dims", "requests", "pp_sync", "agreement", "poison"),
    [
        pytest.param((1, 1, 1), "partitioned", "chain", ((0,),), (), id="single"),
        pytest.param((2, 1, 1), "partitioned", "chain", ((0,), (1,)), (0, 1), id="dp2-part"),
        pytest.param((2, 1, 1), "replicated", "chain", ((0, 1),), (), id="dp2-repl"),
        pytest.param((2, 2, 1), "partitioned", "chain", ((0,), (2,)), (0, 2), id="dp2pp2-part"),
        pytest.param((2, 2, 1), "replicated", "chain", ((0, 2),), (), id="dp2pp2-repl"),
        pytest.param(
            (2, 2, 1), "partitioned", "collective", ((0, 1), (2, 3)), (0, 1, 2, 3), id="dp2pp2-coll"
        ),
        pytest.param(
            (2, 2, 1), "replicated", "collective", ((0, 1, 2, 3),), (), id="dp2pp2-repl-coll"
        ),
        pytest.param((2, 1, 2), "replicated", "chain", ((0, 2),), (), id="dp2tp2-repl"),
        pytest.param((1, 3, 2), "partitioned", "collective", ((0, 2, 4),), (), id="pp3tp2-coll"),
    ],
)
def test_agreement_and_poison_groups(dims, requests, pp_sync, agreement, poison):
    lay = layout(*dims, requests=requests, pp_sync=pp_sync)
    assert lay.agreement_groups() == agreement
    assert lay.poison_group() == poison
    for group in agreement:
        for r in group:
            assert lay.agreement_group(r) == group
    followers = [r for r in range(lay.world_size) if not any(r in g for g in agreement)]
    assert all(lay.agreement_group(r) == () for r in followers)


@pytest.mark.parametrize(
    ("dims", "chains", "tp_groups", "dp_leaders"),
    [
        pytest.param((1, 3, 1), ((0, 1, 2),), ((0,), (1,), (2,)), (0,), id="pp3"),
        pytest.param(
            (2, 2, 2), ((0, 2), (4, 6)), ((0, 1), (2, 3), (4, 5), (6, 7)), (0, 4), id="222"
        ),
        pytest.param((1, 1, 4), ((0,),), ((0, 1, 2, 3),), (0,), id="tp4"),
    ],
)
def test_chains_tp_groups_and_dp_leaders(dims, chains, tp_groups, dp_leaders):
    lay = layout(*dims)
    assert lay.pp_chains() == chains
    assert lay.tp_groups() == tp_groups
    assert lay.dp_leaders() == dp_leaders
    for chain in chains:
        assert lay.chain_prev(chain[0]) is None and lay.chain_next(chain[-1]) is None
        for a, b in itertools.pairwise(chain):
            assert lay.chain_next(a) == b and lay.chain_prev(b) == a


def test_collective_has_no_chain_and_workers_have_no_links():
    coll = layout(1, 3, 2, pp_sync="collective")
    assert all(coll.chain_next(r) is None and coll.chain_prev(r) is None for r in range(6))
    chain = layout(1, 3, 2)
    assert chain.chain_next(1) is None and chain.chain_prev(3) is None


def test_control_groups_skip_singletons_and_name_everything():
    names = [n for n, _ in layout(2, 2, 2).control_groups()]
    assert names == ["poison", "pp_chain", "pp_chain", "tp", "tp", "tp", "tp", "replicas", "world"]
    assert layout(1, 1, 1).control_groups() == ()


@pytest.mark.parametrize(
    ("config", "world", "message"),
    [
        pytest.param(
            ParallelConfig(dp=2, tp=2),
            6,
            r"2\*1\*2 = 4 does not match the world size 6; valid \(dp, pp, tp\): "
            r"\(1, 1, 6\), \(1, 2, 3\), \(1, 3, 2\), \(1, 6, 1\), \(2, 1, 3\), \(2, 3, 1\), "
            r"\(3, 1, 2\), \(3, 2, 1\), \(6, 1, 1\)",
            id="product-mismatch",
        ),
        pytest.param(ParallelConfig(), 0, "world size must be >= 1", id="empty-world"),
    ],
)
def test_build_errors_name_valid_values(config, world, message):
    with pytest.raises(LayoutError, match=message):
        ParallelLayout.build(config, world)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(dict(dp=0, pp=1, tp=1), r"parallel.dp must be an integer >= 1", id="dp0"),
        pytest.param(
            dict(dp=1, pp=1, tp=1, requests="shared"), "'partitioned' or 'replicated'", id="req"
        ),
        pytest.param(dict(dp=1, pp=1, tp=1, pp_sync="ring"), "'chain' or 'collective'", id="sync"),
    ],
)
def test_bad_values(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        ParallelLayout(**kwargs)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(
            lambda lay: lay.coords(8), r"rank 8 out of range; valid ranks are 0..7", id="rank"
        ),
        pytest.param(
            lambda lay: lay.rank_of(0, 2, 0), r"pp index 2 out of range; valid are 0..1", id="pp"
        ),
        pytest.param(
            lambda lay: lay.rank_of(0, 0, 5), r"tp index 5 out of range; valid are 0..1", id="tp"
        ),
    ],
)
def test_out_of_range(call, message):
    with pytest.raises(LayoutError, match=message):
        call(layout(2, 2, 2))


@pytest.mark.parametrize(
    ("config", "world", "dims"),
    [
        pytest.param(ParallelConfig(), 4, (4, 1, 1), id="derive-dp"),
        pytest.param(ParallelConfig(tp=2), 4, (2, 1, 2), id="derive-dp-tp2"),
        pytest.param(ParallelConfig(dp=2, pp=2), 4, (2, 2, 1), id="explicit"),
    ],
)
def test_from_world(config, world, dims):
    lay = ParallelLayout.from_world(config, world)
    assert (lay.dp, lay.pp, lay.tp) == dims


def test_from_world_rejects_misfit():
    with pytest.raises(LayoutError, match="valid"):
        ParallelLayout.from_world(ParallelConfig(pp=3), 4)


def test_describe_names_roles():
    assert layout(1, 2, 2).describe(3) == "rank 3 (dp0 pp1 tp1: TP worker, last stage)"
    assert (
        layout(1, 1, 1).describe(0) == "rank 0 (dp0 pp0 tp0: stage leader, first stage, last stage)"
    )


def test_large_agreement_groups_switch_to_the_fixed_size_report():
    from gramcoord.coordinator.config import DistributedConfig
    from gramcoord.coordinator.coordinator import Coordinator
    from tests.coordinator.fakes import ThreadComm, ThreadHub

    lay = ParallelLayout.build(ParallelConfig(dp=4, requests="replicated"), 4)
    hub = ThreadHub()
    for reduce_from, op in ((4, "all_reduce"), (5, "all_gather")):
        dist_cfg = DistributedConfig(agreement_reduce_from=reduce_from)
        coord = Coordinator.from_config(lay, ThreadComm(hub, lay, 0), dist_cfg, max_pending=8)
        assert coord.agreement.op == op


# -- step routes ---------------------------------------------------------------


@pytest.mark.parametrize(
    "dp,pp,tp", [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 3, 1), (2, 2, 2), (1, 2, 3)]
)
def test_step_routes_deliver_every_frame_once_from_its_origin(dp, pp, tp):
    layout = ParallelLayout(dp=dp, pp=pp, tp=tp)
    routes = {r: layout.step_route(r) for r in range(layout.world_size)}
    for r, route in routes.items():
        c = layout.coords(r)
        assert (route.frame_src is None) == (c.pp == 0 and c.tp == 0), r
        for dst in route.frame_dsts:  # what a rank sends, its destination takes from it
            assert routes[dst].frame_src == r, (r, dst)
        assert route.first_leader == layout.leader(c.dp, 0)
        assert route.last_leader == layout.leader(c.dp, pp - 1)
        assert route.prev_leader == (layout.leader(c.dp, c.pp - 1) if c.pp else None)
        assert route.next_leader == (layout.leader(c.dp, c.pp + 1) if c.pp < pp - 1 else None)
    # Following sources back from any rank ends at its replica's origin.
    for r in routes:
        seen, at = set(), r
        while routes[at].frame_src is not None:
            assert at not in seen
            seen.add(at)
            at = routes[at].frame_src
        assert at == routes[r].first_leader


def test_step_route_of_a_two_stage_tp_pair():
    layout = ParallelLayout(dp=1, pp=2, tp=2)  # ranks: (pp0: 0, 1), (pp1: 2, 3)
    assert layout.step_route(0).frame_dsts == (1, 2)  # its TP worker first, then stage 1
    assert layout.step_route(1)[2:4] == (0, (3,))
    assert layout.step_route(2)[:4] == (0, None, 0, ())
    assert layout.step_route(3)[2:4] == (1, ())
