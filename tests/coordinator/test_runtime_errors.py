"""Start-up errors of the runtime and the external launcher, in one process."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch.distributed as dist

from gramcoord.coordinator import groups
from gramcoord.coordinator.config import DistributedConfig, ParallelConfig
from gramcoord.coordinator.errors import CoordinatorError, PeerLostError
from gramcoord.coordinator.external import attach_external
from gramcoord.coordinator.groups import GroupCalls
from gramcoord.coordinator.layout import ParallelLayout
from gramcoord.coordinator.runtime import Runtime, roll_call

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


# -- how long naming the lost may take --------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def monotonic(self) -> float:
        return self.t


class _FailingWork:
    """A call that fails after ``after_s`` on the test's clock."""

    def __init__(self, clock: _Clock, after_s: float) -> None:
        self.clock, self.after_s = clock, after_s

    def wait(self, timeout) -> None:
        self.clock.t += self.after_s
        raise RuntimeError("Connection closed by peer")


class _Calls(GroupCalls):
    def _lost(self, group, operation, step, peer, exc) -> None:
        self.roll_call_s = self.time_left()


@pytest.mark.parametrize(
    ("after_s", "startup", "expected"),
    [
        # Timed out (OP_SHARE of 30 s): the rest, 6 s (was capped at 2 s).
        pytest.param(24.0, False, 6.0, id="timed-out"),
        # Failed at once (a peer closed its groups): nearly all of it.
        pytest.param(0.5, False, 29.5, id="failed-at-once"),
        # Inside startup(): of the start-up timeout.
        pytest.param(1.0, True, 99.0, id="startup"),
    ],
)
def test_a_roll_call_gets_what_the_failed_call_left_of_its_timeout(
    monkeypatch, after_s, startup, expected
):
    clock = _Clock()
    monkeypatch.setattr(groups, "time", clock)
    calls = _Calls(rank=0, step_timeout_s=30.0, init_timeout_s=100.0)
    clock.t += 50  # idle between calls: not counted
    with calls.startup() if startup else contextlib.nullcontext():
        calls._wait(_FailingWork(clock, after_s), "world", "agreement", 3, None)
    assert calls.roll_call_s == pytest.approx(expected)


class _Store:
    """A rendezvous store where rank 1 answers at its ``answer_at``-th look;
    from its ``slow_from``-th look on, each look takes ``slow_s``."""

    def __init__(self, answer_at: int | None, slow_from: int = 0, slow_s: float = 0.0) -> None:
        self.keys: set[str] = set()
        self.looks, self.answer_at = 0, answer_at
        self.slow_from, self.slow_s = slow_from, slow_s

    def set(self, key: str, value: str) -> None:
        self.keys.add(key)

    def check(self, keys: list[str]) -> bool:
        self.looks += 1
        if self.slow_from and self.looks >= self.slow_from:
            time.sleep(self.slow_s)
        if self.looks == self.answer_at:
            self.keys.add("p/1")
        return all(k in self.keys for k in keys)


def test_a_late_answer_within_the_window_is_not_lost_and_silence_is():
    assert roll_call(_Store(answer_at=5), "p/", 0, (0, 1), timeout_s=60.0)[0] == ()
    lost, how = roll_call(_Store(answer_at=None), "p/", 0, (0, 1), timeout_s=0.1)
    assert lost == (1,) and "no answer to the roll call within 0.1s" in how


def test_a_store_that_answered_a_pass_is_reachable_however_slow_its_last_check():
    # A loaded run: the last check overran the wait, and the survivor could
    # not name the rank its dead host took with it.
    store = _Store(answer_at=None, slow_from=3, slow_s=2.0)
    lost, how = roll_call(store, "p/", 0, (0, 1), timeout_s=0.1)
    assert lost == (1,) and "no answer to the roll call" in how


def test_a_store_that_never_answers_is_the_lost_store_host():
    store = _Store(answer_at=None, slow_from=1, slow_s=2.0)
    lost, how = roll_call(store, "p/", 0, (0, 1), timeout_s=0.1)
    assert lost == () and "the store host may be lost" in how
    assert roll_call(store, "p/", 1, (0, 1), timeout_s=0.1)[0] == (0,)
