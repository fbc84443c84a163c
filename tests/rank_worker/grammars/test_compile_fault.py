"""``faults.compile_delay``: a hung compile times out, is poisoned, and comes back.

A session whose backend hangs the first compile of one key (``seconds:
.inf``, ``times: 1``): the request fails with ``grammar_timeout`` once
``compile_timeout_s`` passes, a repeat of the key fails at once from the
poison cache, the other requests are unaffected, and once ``poison_ttl_s``
has passed the key is compiled again and admitted. The hung compile keeps
its (daemon) thread; closing the session does not wait for it.
"""

from __future__ import annotations

import time

import pytest

from gramcoord.rank_worker.config import (
    CompileDelayFault,
    CompileErrorFault,
    FaultsConfig,
    GrammarConfig,
)
from gramcoord.rank_worker.faults import DelayedCompile, FailingCompile, RankFaults
from gramcoord.rank_worker.session.session import RankSession, SessionConfig
from tests.rank_worker.session_helpers import settle

TTL_S = 1.5
HUNG = {"regex": "hang-me-[0-9]+"}
FINE = {"regex": "fine-[a-z]+"}


def _session(tokenizer) -> RankSession:
    config = SessionConfig(
        grammar=GrammarConfig(num_compile_workers=1, compile_timeout_s=0.5, poison_ttl_s=TTL_S),
        faults=FaultsConfig(
            compile_delay=CompileDelayFault(pattern="hang-me", rank=0, seconds=float("inf"))
        ),
    )
    return RankSession.local(tokenizer, config)


@pytest.mark.timeout(60)
def test_hung_compile_times_out_is_poisoned_then_readmitted_after_the_ttl(tiny_tokenizer):
    s = _session(tiny_tokenizer)
    try:
        assert isinstance(s._roles.manager.service._compile, DelayedCompile)
        assert s.leader.submit("hung", HUNG).status == "pending"
        assert s.leader.submit("fine", FINE).status == "pending"
        admitted, failed = settle(s, timeout_s=30)
        assert [o.request_id for o in admitted] == ["fine"]
        assert [(o.request_id, o.code) for o in failed] == [("hung", "grammar_timeout")]
        poisoned_at = time.monotonic()

        again = s.leader.submit("hung-again", HUNG)
        assert (again.status, again.code, again.cache) == ("failed", "grammar_timeout", "poisoned")

        # Past the TTL (judged on the agreed clock, which a step moves on).
        time.sleep(max(0.0, TTL_S + 0.3 - (time.monotonic() - poisoned_at)))
        s.leader.step(10_000)
        back = s.leader.submit("hung-later", HUNG)
        assert (back.status, back.cache) == ("pending", "miss"), back
        admitted, failed = settle(s, timeout_s=30)
        assert [o.request_id for o in admitted] == ["hung-later"] and not failed
    finally:
        s.close()


def test_unset_faults_install_no_hook(tiny_tokenizer):
    faults = RankFaults.of(None, 0)
    backend = object()
    assert faults.wrap_compile(backend) is backend
    assert not faults.per_step and faults.stall is None and faults.flip_step == -1
    # A fault that names another rank is not this rank's.
    other = RankFaults.of(
        FaultsConfig(
            kill_rank=1, compile_delay=CompileDelayFault(pattern="x", rank=1, seconds=1.0)
        ),
        0,
    )
    assert not other.per_step and other.wrap_compile(backend) is backend


@pytest.mark.timeout(60)
def test_compile_error_fault_fails_matching_keys_with_grammar_invalid(tiny_tokenizer):
    config = SessionConfig(
        grammar=GrammarConfig(num_compile_workers=1),
        faults=FaultsConfig(compile_error=CompileErrorFault(pattern="break-me", rank=0)),
    )
    s = RankSession.local(tiny_tokenizer, config)
    try:
        assert isinstance(s._roles.manager.service._compile, FailingCompile)
        assert s.leader.submit("broken", {"regex": "break-me-[0-9]+"}).status == "pending"
        assert s.leader.submit("fine", FINE).status == "pending"
        admitted, failed = settle(s, timeout_s=30)
        assert [o.request_id for o in admitted] == ["fine"]
        assert [(o.request_id, o.code) for o in failed] == [("broken", "grammar_invalid")]
        assert "faults.compile_error" in failed[0].message
    finally:
        s.close()
    # Another rank's fault installs nothing here.
    backend = object()
    other = FaultsConfig(compile_error=CompileErrorFault(pattern="x", rank=1))
    assert RankFaults.of(other, 0).wrap_compile(backend) is backend
