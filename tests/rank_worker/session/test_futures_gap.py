"""The agreement's gap (``GrammarFutures(max_gap=...)``): while a request waits,
agreements that decide nothing are spaced out, alike on every rank."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest

from gramcoord.coordinator.config import DistributedConfig
from gramcoord.coordinator.layout import ParallelLayout
from gramcoord.rank_worker.session.futures import GrammarFutures
from tests.rank_worker.session.test_leader import SPEC_A, SPEC_B, Ranks

SLOW = "[a-z]+"  # SPEC_A's regex: gated until the test opens it
LAYOUT = ParallelLayout(dp=2, pp=1, tp=1, requests="replicated")


class Futures:
    """Two ranks' ``GrammarFutures`` over real leaders; every call runs on both at once."""

    def __init__(self, tokenizer, max_gap: int) -> None:
        self.ranks = Ranks(tokenizer, LAYOUT, {0: {SLOW}, 1: {SLOW}})
        self.futures = {
            r: GrammarFutures(
                leader, admit=lambda o: o.request_id, refuse=lambda o: o, max_gap=max_gap
            )
            for r, leader in self.ranks.leaders.items()
        }

    def submit(self, request_id: str, spec: dict) -> dict:
        return {r: f.submit(request_id, spec) for r, f in self.futures.items()}

    def step(self) -> tuple[bool, int]:
        """One host step on both ranks: (whether it ran an agreement, requests decided)."""
        before = {r: self.ranks.leaders[r].num_collectives for r in self.futures}
        calls = {r: self.ranks.pool.submit(f.step) for r, f in self.futures.items()}
        decided = {r: c.result(timeout=30) for r, c in calls.items()}
        ran = {r: self.ranks.leaders[r].num_collectives > before[r] for r in self.futures}
        # Both ranks skip the same steps and decide the same requests.
        assert ran[0] == ran[1] and decided[0] == decided[1], (ran, decided)
        return ran[0], decided[0]


@pytest.fixture
def make_futures(tiny_tokenizer):
    made = []

    def make(max_gap: int) -> Futures:
        made.append(Futures(tiny_tokenizer, max_gap))
        return made[-1]

    yield make
    for f in made:
        f.ranks.close()


def _schedule(futures: Futures, steps: int) -> str:
    """Which of ``steps`` host steps ran an agreement: 'A' ran, '.' skipped."""
    return "".join("A" if futures.step()[0] else "." for _ in range(steps))


def test_fruitless_agreements_double_the_gap_up_to_max_gap(make_futures):
    f = make_futures(max_gap=4)
    f.submit("slow", SPEC_A)
    # 4 agreements every step, 4 every 2nd, then every 4th (the cap).
    assert _schedule(f, 4 + 8 + 12) == "AAAA" + ".A" * 4 + "...A" * 3
    assert f.futures[0].gap == f.futures[1].gap == 4


def test_a_new_request_is_agreed_on_at_once_and_resets_the_gap(make_futures):
    f = make_futures(max_gap=8)
    f.submit("slow", SPEC_A)
    _schedule(f, 12)  # the gap is 4 now
    assert f.futures[0].gap == 4
    f.submit("fast", SPEC_B)
    # The next step agrees (a new request); once one decides, the gap is 1 again.
    ran, decided = f.step()
    assert ran and f.futures[0].gap == 1
    for _ in range(2000):
        if decided:
            break
        time.sleep(0.005)
        ran, decided = f.step()
    assert decided == 1 and f.futures[0].gap == 1
    assert f.futures[0].undecided("slow") and not f.futures[0].undecided("fast")


def test_the_waiting_request_is_decided_within_one_gap_of_its_compile(make_futures):
    f = make_futures(max_gap=8)
    futures = f.submit("slow", SPEC_A)
    assert _schedule(f, 40) == "AAAA" + ".A" * 4 + "...A" * 4 + ".......A" + "...."
    for gate in f.ranks.gates.values():
        gate.open.set()
    for m in f.ranks.managers.values():  # both ranks' compiles are done
        assert m.wait_pending(30)
    # The next agreement is at most 8 steps away, and it admits the request.
    steps, decided = 0, 0
    while not decided:
        steps += 1
        _, decided = f.step()
    assert steps <= 8 and decided == 1
    assert futures[0].result(0) == futures[1].result(0) == "slow"


def test_max_gap_one_agrees_every_step(make_futures):
    f = make_futures(max_gap=1)
    f.submit("slow", SPEC_A)
    assert _schedule(f, 20) == "A" * 20


def test_max_gap_is_checked():
    with pytest.raises(ValueError, match="max_gap must be at least 1"):
        GrammarFutures(None, admit=lambda o: o, refuse=lambda o: o, max_gap=0)  # type: ignore[arg-type]
    assert DistributedConfig().agree_max_gap_steps == 8
    with pytest.raises(msgspec.ValidationError, match="agree_max_gap_steps"):
        msgspec.convert({"agree_max_gap_steps": 0}, DistributedConfig)


def test_wait_sleeps_only_while_nothing_undecided_has_compiled_here(make_futures):
    f = make_futures(max_gap=8)
    rank0 = f.futures[0]
    f.submit("slow", SPEC_A)
    start = time.monotonic()
    rank0.wait(0.2)  # only the gated compile: it sleeps on it
    assert time.monotonic() - start >= 0.2
    f.submit("fast", SPEC_B)
    for _ in range(6000):  # the fast compile ends (the slow one stays gated)
        if f.ranks.leaders[0].compiled_here("fast"):
            break
        time.sleep(0.01)
    # A decision is possible now: waiting would only delay it.
    waiter = threading.Thread(target=rank0.wait, args=(600,), daemon=True)
    waiter.start()
    waiter.join(120)
    assert not waiter.is_alive()
    # It returned before the slow compile ended (its gate is still closed).
    assert not f.ranks.leaders[0].compiled_here("slow")
