import os
import signal

import pytest
import torch
import torch.distributed as dist

from gramcoord.launch.procs import SpawnError, run_procs, run_ranks


def _square(rank, n):
    return rank * rank


def _fail_on_one(rank, n):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _die(rank, n):
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def _allreduce(rank, n):
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t.item())


pytestmark = [pytest.mark.spawn, pytest.mark.timeout(120)]


def test_results_in_rank_order():
    assert [r.value for r in run_procs(_square, 3, timeout=60)] == [0, 1, 4]


@pytest.mark.parametrize(
    ("target", "bad_rank", "kind"),
    [
        pytest.param(_fail_on_one, 1, "ValueError", id="exception"),
        pytest.param(_die, 0, "died", id="sigkill"),
    ],
)
def test_failures_are_reported(target, bad_rank, kind):
    with pytest.raises(SpawnError) as info:
        run_procs(target, 2, timeout=60)
    bad = info.value.results[bad_rank]
    assert not bad.ok and bad.error_type == kind
    assert f"rank {bad_rank}" in str(info.value)


def test_gloo_group():
    assert [r.value for r in run_ranks(_allreduce, 2, timeout=60)] == [3, 3]
