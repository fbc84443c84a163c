"""Start-up errors of the runtime and the external launcher, in one process."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from gramcoord.coordinator.config import DistributedConfig, ParallelConfig
from gramcoord.coordinator.errors import CoordinatorError, PeerLostError
from gramcoord.coordinator.external import attach_external
from gramcoord.coordinator.layout import ParallelLayout
from gramcoord.coordinator.runtime import Runtime

LAYOUT = ParallelLayout(dp=2, pp=1, tp=1)


@pytest.fixture(autouse=True)
def _no_world():
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(
            lambda: attach_external(ParallelConfig(), DistributedConfig()),
            "needs the host to call torch.distributed.init_process_group",
            id="external-without-world",
        ),
        pytest.param(
            lambda: Runtime.attach(LAYOUT, distributed=DistributedConfig()),
            "not initialized; the host must call init_process_group",
            id="attach-without-world",
        ),
        pytest.param(
            lambda: Runtime.start(LAYOUT, rank=0, distributed=DistributedConfig(master_port=0)),
            "master_port is 0 and MASTER_PORT is unset",
            id="start-without-port",
        ),
    ],
)
def test_startup_errors_say_what_to_do(monkeypatch, call, message):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(CoordinatorError, match=message):
        call()


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        pytest.param((2,), "rank 2 lost during 'agreement' at step 7", id="one"),
        pytest.param((1, 3), "ranks [1, 3] lost during 'agreement' at step 7", id="two"),
        pytest.param((), "an unidentified rank lost during 'agreement'", id="unknown"),
    ],
)
def test_peer_lost_message_names_ranks_and_operation(ranks, expected):
    err = PeerLostError(
        rank=0, ranks=ranks, operation="agreement", step=7, group=(0, 1, 2, 3), detail="x"
    )
    assert expected in str(err) and "[rank 0]" in str(err) and "group [0, 1, 2, 3]" in str(err)
