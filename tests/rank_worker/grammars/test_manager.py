"""GrammarManager paths: miss, hit, joined, poisoned, timeout, saturation, sync."""

from __future__ import annotations

import threading
import time

import pytest

from gramcoord.coordinator.status import Decision, PendingState, PoisonRecord, decide_alone
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.errors import ErrorCode
from gramcoord.rank_worker.grammars.compile_job import CompileJob
from gramcoord.rank_worker.grammars.compile_service import XGrammarBackend
from gramcoord.rank_worker.grammars.manager import GrammarManager
from gramcoord.rank_worker.grammars.spec import validate_spec

SCHEMA_A = {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}
SCHEMA_B = {"json": {"type": "object", "properties": {"b": {"type": "string"}}}}


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class GatedBackend:
    """The real xgrammar backend, but each compile waits for a gate.

    Lets tests hold a compile "running" as long as they like, without
    sleeping, and count how many compiles really ran.
    """

    def __init__(self, tokenizer, *, fail_on: str | None = None) -> None:
        self.real = XGrammarBackend(tokenizer)
        self.gate = threading.Event()
        self.started = threading.Semaphore(0)
        self.calls = 0
        self.fail_on = fail_on

    def __call__(self, spec):
        self.calls += 1
        self.started.release()
        assert self.gate.wait(30), "test never opened the gate"
        if self.fail_on and self.fail_on in spec.text:
            raise RuntimeError("injected compile failure")
        return self.real(spec)


def make(tokenizer, backend=None, **cfg):
    clock, wall = FakeClock(), [10_000]
    manager = GrammarManager(
        GrammarConfig(**cfg),
        tokenizer,
        compile_fn=backend,
        clock=clock,
    )
    # The agreed clock of a single process is the wall clock; tests move it.
    single_step = manager.step
    manager.step = lambda step=0: single_step(step, clock_ms=wall[0])
    return manager, clock, wall


def drain(manager, limit_s: float = 20.0):
    """Step until the window is empty (real compiles finish quickly)."""
    out, end = [], time.monotonic() + limit_s
    while manager.num_pending or manager.num_waiting:
        out += manager.step()
        assert time.monotonic() < end, "requests never settled"
        time.sleep(0.002)
    return out


def test_miss_then_hit(tiny_tokenizer):
    m, _, _ = make(tiny_tokenizer)
    first = m.add("r1", SCHEMA_A)
    assert (first.status, first.cache) == ("pending", "miss")
    [done] = drain(m)
    assert done.status == "admitted" and done.compile_ms > 0
    again = m.add("r2", SCHEMA_A)
    assert again.cache == "hit"
    assert m.local_status().states == (int(PendingState.READY),)
    [hit] = m.step()
    assert hit.status == "admitted" and hit.cache == "hit"
    matcher = m.matcher("r2")
    assert matcher.accept_string('{"a": 12}') and matcher.is_completed()
    assert m.service.num_compiles == 1


def test_joined_compiles_once(tiny_tokenizer):
    backend = GatedBackend(tiny_tokenizer)
    m, _, _ = make(tiny_tokenizer, backend)
    outcomes = [m.add(f"r{i}", SCHEMA_A) for i in range(5)]
    assert [o.cache for o in outcomes] == ["miss"] + ["joined"] * 4
    backend.gate.set()
    done = drain(m)
    assert [o.status for o in done] == ["admitted"] * 5
    assert [o.seq for o in done] == [0, 1, 2, 3, 4]
    assert backend.calls == 1


def test_invalid_compile_poisons_permanently(tiny_tokenizer):
    m, _, _ = make(tiny_tokenizer)
    bad = {"grammar": "root ::= undefined_rule"}
    m.add("r1", bad)
    failed = []
    while not failed:  # the multi-rank path keeps records for DP peers
        failed = m.apply_decision(decide_alone(0, m.local_status(), 10_000))
    [failed] = failed
    assert failed.status == "failed" and failed.code == "grammar_invalid"
    [rec] = m.new_failures()
    assert rec.reason == ErrorCode.grammar_invalid
    compiles = m.service.num_compiles
    repeat = m.add("r2", bad)
    assert (repeat.status, repeat.cache, repeat.code) == ("failed", "poisoned", "grammar_invalid")
    assert m.num_pending == 0 and m.service.num_compiles == compiles


class FinishesOnFirstLook(threading.Event):
    """A job's ``done`` that the compile sets at the first look at it, just
    before the look returns: the worker ending between two reads of the
    job's state, forced instead of waited for."""

    def __init__(self, finish) -> None:
        super().__init__()
        self._finish = finish

    def is_set(self) -> bool:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return super().is_set()


def _fail_now(job, message: str = "injected compile failure"):
    def finish() -> None:  # as CompileService._run: the error, then done
        job.error = (ErrorCode.grammar_invalid, message)
        threading.Event.set(job.done)

    return finish


def test_a_job_failing_while_its_state_is_read_is_never_ready():
    job = CompileJob(validate_spec({"grammar": "root ::= x"}, GrammarConfig(), vocab="tiny"))
    job.done = FinishesOnFirstLook(_fail_now(job))
    assert job.state() == (PendingState.FAILED, int(ErrorCode.grammar_invalid))


def test_a_compile_failing_while_the_window_is_read_still_poisons(tiny_tokenizer):
    """Under load the compile ended between the two reads
    of the job's state, the request was called ready, and failed only at its
    admission, without poisoning its key (``new_failures()`` was empty)."""
    backend = GatedBackend(tiny_tokenizer)
    m, _, _ = make(tiny_tokenizer, backend)
    try:
        m.add("r1", SCHEMA_A)
        assert backend.started.acquire(timeout=10)  # the worker holds the job
        [entry] = m._pending.values()
        entry.job.done = FinishesOnFirstLook(_fail_now(entry.job))
        [failed] = m.apply_decision(decide_alone(0, m.local_status(), 10_000))
        assert (failed.status, failed.code) == ("failed", "grammar_invalid")
        [rec] = m.new_failures()
        assert rec.reason == ErrorCode.grammar_invalid
    finally:
        backend.gate.set()
        m.close()


def test_timeout_poisons_with_ttl(tiny_tokenizer):
    backend = GatedBackend(tiny_tokenizer)
    m, clock, wall = make(
        tiny_tokenizer, backend, compile_timeout_s=5, poison_ttl_s=60, num_compile_workers=2
    )
    m.add("slow", SCHEMA_A)
    assert backend.started.acquire(timeout=10)
    assert m.step() == []  # running, within its deadline
    clock.t += 6
    [failed] = m.step()
    assert (failed.status, failed.code) == ("failed", "grammar_timeout")
    # The late result is dropped, not cached.
    backend.gate.set()
    repeat = m.add("again", SCHEMA_A)
    assert (repeat.cache, repeat.code) == ("poisoned", "grammar_timeout")
    # TTL runs on the agreed clock: expiry is decided at a decision point.
    wall[0] += 61_000
    m.apply_decision(Decision(step=1, clock_ms=wall[0]))
    fresh = m.add("fresh", SCHEMA_A)
    assert fresh.cache == "miss"
    assert drain(m)[0].status == "admitted"


def test_saturation_fails_fast_and_recovers(tiny_tokenizer):
    backend = GatedBackend(tiny_tokenizer)
    m, clock, _ = make(
        tiny_tokenizer, backend, compile_timeout_s=5, num_compile_workers=1, num_stuck_compiles=1
    )
    m.add("stuck", SCHEMA_A)
    assert backend.started.acquire(timeout=10)
    m.add("queued", SCHEMA_B)  # waits behind the stuck compile
    clock.t += 6
    outcomes = {o.request_id: o for o in m.step()}
    assert outcomes["stuck"].code == "grammar_timeout"
    assert outcomes["queued"].code == "grammar_pool_saturated"
    assert m.service.num_stuck() == 1
    new = m.add("new", {"regex": "[a-z]+"})
    [fast] = m.step()
    assert (new.cache, fast.code) == ("miss", "grammar_pool_saturated")
    # Saturation is not the spec's fault: no poison.
    new_key = validate_spec({"regex": "[a-z]+"}, m.config, vocab="tiny").key
    assert m.caches.poisoned(new_key) is None
    backend.gate.set()
    end = time.monotonic() + 10
    while m.service.num_stuck():
        assert time.monotonic() < end
        time.sleep(0.01)
    m.add("later", {"regex": "[a-z]+"})
    assert drain(m)[0].status == "admitted"


def test_stuck_worker_is_replaced(tiny_tokenizer):
    backend = GatedBackend(tiny_tokenizer)
    m, clock, _ = make(
        tiny_tokenizer, backend, compile_timeout_s=5, num_compile_workers=1, num_stuck_compiles=2
    )
    m.add("stuck", SCHEMA_A)
    assert backend.started.acquire(timeout=10)
    m.add("queued", SCHEMA_B)
    clock.t += 6
    [timed_out] = m.step()
    assert timed_out.code == "grammar_timeout"
    # A spare worker took the stuck one's place: the queued compile starts
    # even though the stuck compile still holds its thread.
    assert backend.started.acquire(timeout=10)
    assert m.service.num_stuck() == 1
    backend.gate.set()
    [done] = drain(m)
    assert (done.request_id, done.status) == ("queued", "admitted")


def test_sync_mode_compiles_inline_without_timeout(tiny_tokenizer):
    m, clock, _ = make(tiny_tokenizer, compile_mode="sync", compile_timeout_s=0.001)
    out = m.add("r1", SCHEMA_A)
    assert out.status == "pending"
    assert m.local_status().states == (int(PendingState.READY),)
    clock.t += 100
    [done] = m.step()
    assert done.status == "admitted"


def test_pending_window_overflow_waits(tiny_tokenizer):
    m, _, _ = make(tiny_tokenizer, compile_mode="sync", max_pending=2)
    outs = [m.add(f"r{i}", {"regex": f"a{{{i + 1}}}"}) for i in range(5)]
    assert [o.status for o in outs] == ["pending", "pending", "waiting", "waiting", "waiting"]
    assert m.num_pending == 2 and m.num_waiting == 3
    done = drain(m)
    assert [o.request_id for o in done] == [f"r{i}" for i in range(5)]


def test_abort_pending_and_waiting(tiny_tokenizer):
    backend = GatedBackend(tiny_tokenizer)
    m, _, _ = make(tiny_tokenizer, backend, max_pending=1)
    m.add("a", SCHEMA_A)
    m.add("b", SCHEMA_B)
    assert m.release("b") and m.num_waiting == 0
    assert m.release("a") and m.num_pending == 0
    assert not m.release("a")
    backend.gate.set()
    assert m.step() == []


def test_decision_order_and_failed_wins(tiny_tokenizer):
    m, _, _ = make(tiny_tokenizer, compile_mode="sync")
    for i in range(4):
        m.add(f"r{i}", {"regex": f"b{{{i + 1}}}"})
    # A decision from the group: seq 1 failed elsewhere (timeout), even
    # though it is ready here; 3 stays pending.
    out = m.apply_decision(Decision(step=1, ready=(2, 0, 1), failed=((1, 21),), clock_ms=5))
    assert [(o.seq, o.status) for o in out] == [(0, "admitted"), (1, "failed"), (2, "admitted")]
    assert out[1].code == "grammar_timeout" and "another rank" in out[1].message
    assert m.local_status().seqs == (3,)
    [rec] = m.new_failures()
    assert rec.clock_ms == 5


def test_shared_poison_fails_pending_and_new(tiny_tokenizer):
    backend = GatedBackend(tiny_tokenizer)
    m, _, _ = make(tiny_tokenizer, backend)
    m.add("r1", SCHEMA_A)
    key = m._pending[0].spec.key
    m.apply_poison([PoisonRecord(key, int(ErrorCode.grammar_invalid), 0)])
    assert m.local_status().states == (int(PendingState.FAILED),)
    [failed] = m.step()
    assert failed.code == "grammar_invalid"
    assert m.add("r2", SCHEMA_A).cache == "poisoned"
    backend.gate.set()


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(None, id="none"),
        pytest.param(
            {"json": {"type": "object", "properties": {"a": {"type": 5}}}}, id="bad-type-keyword"
        ),
        pytest.param({"regex": "(unclosed"}, id="bad-regex"),
        pytest.param({"structural_tag": {"type": "nonsense"}}, id="bad-structural-tag"),
        pytest.param({"grammar": "start: undefined"}, id="bad-lark"),
        pytest.param({"json": "[" * 5000}, id="json-bomb"),
        pytest.param(object(), id="not-a-mapping"),
    ],
)
def test_bad_input_never_raises(tiny_tokenizer, spec):
    m, _, _ = make(tiny_tokenizer)
    first = m.add("r", spec)
    outcomes = [first] if first.status == "failed" else drain(m)
    assert outcomes[0].status == "failed" and outcomes[0].code
    assert m.add("ok", {"regex": "x"}).status == "pending"


def test_real_vocab_special_tokens_never_allowed(qwen_tokenizer):
    m, _, _ = make(qwen_tokenizer, compile_mode="sync")
    m.add("r", {"json": {"type": "string"}})
    m.step()
    import xgrammar as xgr

    matcher = m.matcher("r")
    mask = xgr.allocate_token_bitmask(1, qwen_tokenizer.vocab_size)
    matcher.accept_string('"')
    matcher.fill_next_token_bitmask(mask)
    im_start = qwen_tokenizer.special_ids["<|im_start|>"]
    assert not (mask[0, im_start // 32] >> (im_start % 32)) & 1


def test_single_rank_step_keeps_no_poison_records(tiny_tokenizer):
    m, _, _ = make(tiny_tokenizer)
    m.add("r1", {"grammar": "root ::= nowhere"})
    assert drain(m)[0].code == "grammar_invalid"
    assert m.new_failures() == []


def test_duplicate_live_id_fails_only_that_request(tiny_tokenizer):
    m, _, _ = make(tiny_tokenizer, compile_mode="sync")
    assert m.add("same", {"regex": "a"}).status == "pending"
    dup = m.add("same", {"regex": "b"})
    assert (dup.status, dup.code) == ("failed", "duplicate_request_id")
    assert [o.status for o in m.step()] == ["admitted"]


def test_finished_job_is_joined_until_decided(tiny_tokenizer):
    backend = GatedBackend(tiny_tokenizer)
    backend.gate.set()
    m, _, _ = make(tiny_tokenizer, backend)
    m.add("a", SCHEMA_A)
    job = m._pending[0].job
    assert job.done.wait(10)
    # Compiled, but no decision yet: a new request joins, it does not recompile.
    assert m.add("b", SCHEMA_A).cache == "joined"
    assert backend.calls == 1
    assert [o.status for o in drain(m)] == ["admitted", "admitted"]
    assert m.service.inflight(job.key) is None  # released once decided


def test_abort_releases_the_job(tiny_tokenizer):
    backend = GatedBackend(tiny_tokenizer)
    m, _, _ = make(tiny_tokenizer, backend, num_compile_workers=1)
    m.add("running", SCHEMA_A)
    assert backend.started.acquire(timeout=10)
    m.add("queued", SCHEMA_B)
    queued_job = m._pending[1].job
    assert m.release("queued") and m.release("running")
    assert m.service.inflight(queued_job.key) is None
    # The queued job is never compiled for nobody.
    assert queued_job.done.is_set() and queued_job.error[0] is ErrorCode.aborted
    backend.gate.set()
    m.add("again", {"regex": "z"})
    drain(m)
    assert backend.calls == 2  # "running" and "again", never "queued"


def test_follower_decisions_enforce_deadlines(tiny_tokenizer):
    backend = GatedBackend(tiny_tokenizer)
    m, clock, _ = make(tiny_tokenizer, backend, compile_timeout_s=5, num_compile_workers=1)
    m.add("slow", SCHEMA_A)
    assert backend.started.acquire(timeout=10)
    m.add("next", {"regex": "q"})
    clock.t += 6
    # A later stage only applies decisions (it never asks local_status):
    # stage 0 failed "slow"; "next" must still get a worker and compile.
    m.follow(0)
    out = m.apply_decision(Decision(step=1, failed=((0, 21),), clock_ms=1))
    assert out[0].code == "grammar_timeout"
    assert backend.started.acquire(timeout=10)  # a spare worker took "next"
    backend.gate.set()
    m.follow(10)
    [admitted] = m.apply_decision(Decision(step=2, ready=(1,), clock_ms=2))
    assert admitted.status == "admitted"


@pytest.mark.parametrize(
    "rid",
    [
        pytest.param("", id="empty"),
        pytest.param("x" * 1025, id="too-long"),
        pytest.param(7, id="not-text"),
    ],
)
def test_bad_request_id_fails_only_that_request(tiny_tokenizer, rid):
    m, _, _ = make(tiny_tokenizer, compile_mode="sync")
    out = m.add(rid, {"regex": "a"})
    assert (out.status, out.code) == ("failed", "bad_request_id")
    assert m.add("fine", {"regex": "a"}).status == "pending"


@pytest.mark.parametrize(
    ("spec", "max_tokens", "fails"),
    [
        pytest.param({"regex": "a{100000}"}, 256, True, id="regex-repeat"),
        pytest.param({"regex": "a{100000}"}, 200_000, False, id="regex-repeat-room"),
        pytest.param({"json": {"type": "string", "minLength": 10**8}}, 256, True, id="minLength"),
        pytest.param(
            {"json": {"type": "array", "items": {"type": "integer"}, "minItems": 10**6}},
            256,
            True,
            id="minItems",
        ),
        pytest.param(
            {
                "json": {
                    "type": "object",
                    "properties": {"k": {"type": "string", "minLength": 900}},
                    "required": ["k"],
                }
            },
            64,
            True,
            id="required-property",
        ),
        pytest.param({"json": {"type": "string", "minLength": 4}}, 256, False, id="reachable"),
        pytest.param({"choice": ["x" * 5000, "y" * 3000]}, 8, True, id="choice"),
        pytest.param({"grammar": 'root ::= "a"*'}, 1, False, id="lark-no-bound"),
    ],
)
def test_a_grammar_that_cannot_end_within_max_tokens_fails_at_admission(
    tiny_tokenizer, spec, max_tokens, fails
):
    m, _, _ = make(tiny_tokenizer, compile_mode="sync")
    out = m.add("r", spec, max_tokens=max_tokens)
    if fails:
        assert (out.status, out.code) == ("failed", "grammar_unreachable_end")
        assert f"max_tokens is {max_tokens}" in out.message
        assert m.service.num_compiles == 0  # refused before any compile
    else:
        assert out.status == "pending", out
    # Without a budget nothing is refused for length.
    assert m.add("r2", spec).status == "pending"
