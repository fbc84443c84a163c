"""The spec store (``grammar.store``): specs kept as plain records, compiled again at
start on the store's thread, joined by their requests, refused record by record,
and verdicts shared between engines on one directory."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest

from gramcoord.coordinator.config import DistributedConfig
from gramcoord.coordinator.layout import ParallelLayout
from gramcoord.coordinator.status import PoisonRecord, wall_clock_ms
from gramcoord.rank_worker.config import GrammarConfig, SpecStoreConfig
from gramcoord.rank_worker.errors import ErrorCode
from gramcoord.rank_worker.grammars.compile_service import XGrammarBackend
from gramcoord.rank_worker.grammars.manager import GrammarManager
from gramcoord.rank_worker.grammars.spec import validate_spec
from gramcoord.rank_worker.grammars.spec_store import FORMAT, SpecRecord, SpecStore
from gramcoord.rank_worker.session.leader import StageLeader
from tests.coordinator.fakes import ThreadComm, ThreadHub

SPECS = [
    {"regex": "[a-z]{2,5}"},
    {"json": json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})},
    {"choice": ["red", "green", "blue"]},
]
WAIT_S = 60.0


class Counting:
    """The real backend, counting compiles per spec text; ``gate`` holds gated texts."""

    def __init__(self, tokenizer, gated: set[str] = frozenset(), spin_s: dict | None = None):
        self.real = XGrammarBackend(tokenizer)
        self.counts: dict[str, int] = {}
        self.gated = set(gated)
        self.gate = threading.Event()
        self.spin_s = spin_s or {}
        self.started = threading.Event()

    def __call__(self, spec):
        self.counts[spec.text] = self.counts.get(spec.text, 0) + 1
        self.started.set()
        if spec.text in self.gated:
            assert self.gate.wait(WAIT_S), "the test never opened the gate"
        spin = self.spin_s.get(spec.text)
        if spin:  # computes (own CPU time) past the deadline
            end = time.thread_time() + spin
            while time.thread_time() < end:
                pass
        return self.real(spec)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _config(root, **store) -> GrammarConfig:
    return GrammarConfig(
        num_compile_workers=1,
        store=SpecStoreConfig(dir=None if root is None else str(root), **store),
    )


def _decide(manager: GrammarManager, rid: str):
    """Step alone until ``rid`` is decided; its outcome."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        manager.wait_pending(0.05)
        for o in manager.step():
            if o.request_id == rid:
                return o
    raise AssertionError(f"{rid} not decided in {WAIT_S}s")


def _serve(manager: GrammarManager, specs, prefix="r"):
    outcomes = []
    for i, spec in enumerate(specs):
        rid = f"{prefix}{i}"
        first = manager.add(rid, spec)
        outcome = first if first.status == "failed" else _decide(manager, rid)
        outcomes.append(outcome)
        manager.release(rid)
    return outcomes


def _settle(manager: GrammarManager) -> None:
    """Let the store's thread write what it was handed."""
    manager.store.close()
    manager.store = None


def _served_before(root, tokenizer, managers, specs) -> GrammarManager:
    """An engine that served ``specs`` on the store in ``root``, then stopped."""
    first = managers(_config(root), tokenizer, Counting(tokenizer))
    _serve(first, specs)
    _settle(first)
    first.close()
    return first


@pytest.fixture
def managers():
    made: list[GrammarManager] = []

    def make(config, tokenizer, backend) -> GrammarManager:
        made.append(GrammarManager(config, tokenizer, compile_fn=backend))
        return made[-1]

    yield make
    for m in made:
        m.close()


def test_admitted_specs_are_kept_as_private_plain_records(tmp_path, tiny_tokenizer, managers):
    root = tmp_path / "store"
    m = managers(_config(root), tiny_tokenizer, Counting(tiny_tokenizer))
    assert all(o.status == "admitted" for o in _serve(m, SPECS))
    _settle(m)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    files = sorted((root / "specs").iterdir())
    assert len(files) == len(SPECS)
    keys = {validate_spec(s, m.config, vocab="tiny").key.hex(): s for s in SPECS}
    for f in files:
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
        record = msgspec.json.decode(f.read_bytes(), type=SpecRecord)
        assert f.name == f"{record.key}.json" and record.vocab == "tiny"
        assert record.format == FORMAT and record.uses == 1
        assert json.loads(record.spec) == keys[record.key]  # the request's own spec, as data


def test_a_restart_compiles_the_stored_specs_and_their_requests_join_them(
    tmp_path, tiny_tokenizer, managers
):
    _served_before(tmp_path, tiny_tokenizer, managers, SPECS)

    backend = Counting(tiny_tokenizer)
    again = managers(_config(tmp_path), tiny_tokenizer, backend)
    assert again.wait_warm(WAIT_S)
    assert backend.total == len(SPECS)  # every stored spec compiled, before any request
    assert (
        again.caches.compiled.get(validate_spec(SPECS[0], again.config, vocab="tiny").key) is None
    )
    outcomes = _serve(again, SPECS)
    assert [o.status for o in outcomes] == ["admitted"] * len(SPECS)
    assert [o.cache for o in outcomes] == ["warm"] * len(SPECS)
    assert backend.total == len(SPECS)  # no compile on any request's path
    assert again.stats.warm == len(SPECS) and again.stats.miss == 0
    # Taken by its request, a warm compile is an ordinary cached grammar: no hold is left.
    assert again._held == {} and again.service._inflight == {}
    assert [o.cache for o in _serve(again, SPECS[:1], prefix="s")] == ["hit"]


class Sized:
    """A compiled grammar whose size reads are counted (xgrammar walks the grammar
    to compute ``memory_size_bytes``)."""

    def __init__(self, compiled) -> None:
        self.compiled, self.reads = compiled, 0

    @property
    def memory_size_bytes(self) -> int:
        self.reads += 1
        return self.compiled.memory_size_bytes


def test_a_warm_grammar_is_sized_once_at_its_compile_not_on_requests(
    tmp_path, tiny_tokenizer, managers
):
    _served_before(tmp_path, tiny_tokenizer, managers, SPECS)
    made: list[Sized] = []
    real = Counting(tiny_tokenizer)

    def backend(spec):
        made.append(Sized(real(spec)))
        return made[-1]

    again = managers(_config(tmp_path), tiny_tokenizer, backend)
    assert again.wait_warm(WAIT_S)
    assert [g.reads for g in made] == [1] * len(SPECS)  # sized for the warm budget
    outcomes = _serve(again, SPECS) + _serve(again, SPECS, prefix="s")
    assert [o.cache for o in outcomes] == ["warm"] * len(SPECS) + ["hit"] * len(SPECS)
    # Neither the first request (it takes the warm compile) nor a cache hit sizes it again.
    assert [g.reads for g in made] == [1] * len(SPECS)
    assert again.caches.compiled.bytes == sum(g.compiled.memory_size_bytes for g in made)


def test_a_request_joins_a_warm_compile_still_running(tmp_path, tiny_tokenizer, managers):
    first = _served_before(tmp_path, tiny_tokenizer, managers, SPECS[:1])

    text = validate_spec(SPECS[0], first.config, vocab="tiny").text
    backend = Counting(tiny_tokenizer, gated={text})
    again = managers(_config(tmp_path), tiny_tokenizer, backend)
    assert backend.started.wait(WAIT_S)  # the warm compile runs, gated
    out = again.add("r", SPECS[0])
    assert out.status == "pending" and out.cache == "warm"
    assert again.step() == []  # not compiled yet: nothing decided
    backend.gate.set()
    assert _decide(again, "r").status == "admitted"
    assert backend.total == 1


def test_a_store_refuses_bad_records_one_by_one_and_the_engine_starts(
    tmp_path, tiny_tokenizer, managers
):
    first = _served_before(tmp_path, tiny_tokenizer, managers, SPECS[:1])
    specs = tmp_path / "specs"
    (good,) = specs.iterdir()
    record = msgspec.json.decode(good.read_bytes(), type=SpecRecord)
    key1 = validate_spec(SPECS[1], first.config, vocab="tiny").key.hex()
    key2 = validate_spec(SPECS[2], first.config, vocab="tiny").key.hex()

    def put(name: str, data) -> None:
        (specs / name).write_bytes(data if isinstance(data, bytes) else msgspec.json.encode(data))

    put("garbage.json", b"\x00\xff not json")
    put("list.json", b"[1, 2, 3]")
    put(f"{key1}.json", msgspec.structs.replace(record, key=key1))  # key is not its spec's
    put(f"{key2}.json", msgspec.structs.replace(record, key=key2, format=FORMAT + 1))
    put("ab" * 16 + ".json", msgspec.structs.replace(record, key="ab" * 16, vocab="qwen"))
    put("cd" * 16 + ".json", msgspec.structs.replace(record, key="cd" * 16, spec='{"regex": "("}'))
    put("ef" * 16 + ".json", {**msgspec.to_builtins(record), "key": "ef" * 16, "exec": "rm -rf"})
    put("big.json", b" " * (2 << 20))
    os.symlink(good, specs / "link.json")
    put(
        "01" * 16 + ".json",
        msgspec.structs.replace(record, key="01" * 16, spec=json.dumps({"json": "{not json"})),
    )

    backend = Counting(tiny_tokenizer)
    again = managers(_config(tmp_path), tiny_tokenizer, backend)
    assert again.wait_warm(WAIT_S)
    refused = "\n".join(again.store.refused)
    for name in ("garbage", "list", "big", "link", "ab" * 16, "ef" * 16):
        assert name in refused, (name, refused)
    assert "format 2" in refused and "foreign" in refused
    assert f"{key1}.json: outdated" in refused  # a key that is not its spec's
    assert "no longer valid" in refused and "01" * 16 in refused  # validated like a request
    assert f"{'cd' * 16}.json: outdated" in refused  # checked before any compile
    assert len(again.store.refused) == 10
    assert backend.total == 1  # the good record alone
    assert [o.status for o in _serve(again, SPECS)] == ["admitted"] * 3


def test_a_full_store_drops_the_least_recently_used(tmp_path, tiny_tokenizer, managers):
    m = managers(_config(tmp_path, max_records=2), tiny_tokenizer, Counting(tiny_tokenizer))
    specs = [{"regex": f"x{i}[0-9]"} for i in range(5)]
    _serve(m, specs)
    _settle(m)
    names = {f.name for f in (tmp_path / "specs").iterdir()}
    assert len(names) == 2
    newest = {validate_spec(s, m.config, vocab="tiny").key.hex() + ".json" for s in specs[-2:]}
    assert names == newest


def test_an_operators_list_is_compiled_at_start_without_a_dir(tmp_path, tiny_tokenizer, managers):
    listed = tmp_path / "tools.jsonl"
    listed.write_text("\n".join([json.dumps(SPECS[0]), "{broken", json.dumps(SPECS[2]), ""]))
    backend = Counting(tiny_tokenizer)
    m = managers(
        GrammarConfig(
            num_compile_workers=1, store=SpecStoreConfig(preload=(str(listed), "/no/such"))
        ),
        tiny_tokenizer,
        backend,
    )
    assert m.wait_warm(WAIT_S)
    assert backend.total == 2
    refused = "\n".join(m.store.refused)
    assert "tools.jsonl:2" in refused and "/no/such" in refused
    assert [o.cache for o in _serve(m, [SPECS[0], SPECS[2]])] == ["warm", "warm"]
    assert not list(tmp_path.glob("specs"))  # no dir: nothing written


def test_a_store_dir_that_cannot_be_made_leaves_the_engine_serving(
    tmp_path, tiny_tokenizer, managers
):
    blocker = tmp_path / "file"
    blocker.write_text("")
    m = managers(_config(blocker / "store"), tiny_tokenizer, Counting(tiny_tokenizer))
    assert m.store.store is None
    assert [o.status for o in _serve(m, SPECS[:1])] == ["admitted"]


def test_bad_store_options_are_refused_with_their_path():
    with pytest.raises(msgspec.ValidationError, match=r"store.max_records"):
        msgspec.convert({"store": {"max_records": 0}}, GrammarConfig)
    with pytest.raises(msgspec.ValidationError, match=r"store.ready_wait_s"):
        msgspec.convert({"store": {"ready_wait_s": -1}}, GrammarConfig)
    with pytest.raises(msgspec.ValidationError, match=r"unknown field"):
        msgspec.convert({"store": {"directory": "/x"}}, GrammarConfig)


def test_a_timeout_on_one_engine_is_refused_at_once_by_another_on_the_same_store(
    tmp_path, tiny_tokenizer, managers
):
    slow = {"regex": "slow[0-9]+"}
    text = validate_spec(slow, GrammarConfig(), vocab="tiny").text
    config = GrammarConfig(
        num_compile_workers=1,
        compile_timeout_s=0.2,
        store=SpecStoreConfig(dir=str(tmp_path), verdict_poll_s=0.05),
    )
    a = managers(config, tiny_tokenizer, Counting(tiny_tokenizer, spin_s={text: 1.5}))
    b_backend = Counting(tiny_tokenizer)
    b = managers(config, tiny_tokenizer, b_backend)
    assert a.add("a", slow).status == "pending"
    assert _decide(a, "a").code == "grammar_timeout"

    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        b.step()  # an engine deciding alone takes the others' verdicts in its step
        if b.caches.poisoned(validate_spec(slow, config, vocab="tiny").key) is not None:
            break
        time.sleep(0.05)
    out = b.add("b", slow)
    assert out.status == "failed" and out.code == "grammar_timeout"
    assert "cached verdict" in out.message
    assert b_backend.total == 0  # B never burnt a compile deadline on it

    # An engine started after the verdict refuses the key at its first request: the
    # verdicts on the store are read during the warm start, and taken at admission.
    c_backend = Counting(tiny_tokenizer)
    c = managers(config, tiny_tokenizer, c_backend)
    StageLeader(c, None)  # decides alone
    assert c.wait_warm(WAIT_S)
    out = c.add("c", slow)
    assert out.status == "failed" and out.code == "grammar_timeout" and c_backend.total == 0


def test_ranks_of_an_agreement_group_never_take_verdicts_between_agreed_points(
    tmp_path, tiny_tokenizer, managers
):
    slow = {"regex": "slow[0-9]+"}
    config = GrammarConfig(store=SpecStoreConfig(dir=str(tmp_path), verdict_poll_s=0.05))
    key = validate_spec(slow, config, vocab="tiny").key
    writer = SpecStore(tmp_path, "tiny", max_records=8, max_spec_bytes=1 << 20)
    timeout = int(ErrorCode.grammar_timeout)
    writer.put_verdict(PoisonRecord(key, timeout, wall_clock_ms(), "timed out elsewhere"))
    m = managers(config, tiny_tokenizer, Counting(tiny_tokenizer))
    layout = ParallelLayout(dp=2, pp=1, tp=1, requests="replicated")
    StageLeader.build(m, layout, ThreadComm(ThreadHub(), layout, 0), DistributedConfig())
    assert m.wait_warm(WAIT_S) and not m.reads_verdicts
    assert m.add("r", slow).status == "pending"  # the group's poison is agreed state


class TwoRanks:
    """Two replicated ranks over one agreement, each with the store, rank 1 warming slowly."""

    def __init__(self, tokenizer, root: Path, gated_text: str) -> None:
        layout = ParallelLayout(dp=2, pp=1, tp=1, requests="replicated")
        hub = ThreadHub()
        self.backends = {0: Counting(tokenizer), 1: Counting(tokenizer, gated={gated_text})}
        self.managers, self.leaders = {}, {}
        for r in (0, 1):
            m = GrammarManager(_config(root), tokenizer, compile_fn=self.backends[r])
            self.managers[r] = m
            self.leaders[r] = StageLeader.build(
                m, layout, ThreadComm(hub, layout, r), DistributedConfig()
            )
        self.pool = ThreadPoolExecutor(2)

    def step(self, n: int) -> dict:
        calls = {r: self.pool.submit(self.leaders[r].step, n) for r in (0, 1)}
        return {r: c.result(timeout=WAIT_S) for r, c in calls.items()}

    def close(self) -> None:
        for b in self.backends.values():
            b.gate.set()
        for m in self.managers.values():
            m.close()
        self.pool.shutdown()


def test_two_ranks_that_warm_at_different_speeds_decide_alike(tmp_path, tiny_tokenizer, managers):
    first = _served_before(tmp_path, tiny_tokenizer, managers, SPECS)

    slow_text = validate_spec(SPECS[1], first.config, vocab="tiny").text
    ranks = TwoRanks(tiny_tokenizer, tmp_path, slow_text)
    try:
        assert ranks.managers[0].wait_warm(WAIT_S)  # rank 0 warmed all; rank 1 is stuck on one
        for i, spec in enumerate(SPECS):
            for r in (0, 1):
                assert ranks.leaders[r].submit(f"q{i}", spec).status == "pending"
        decided = {0: [], 1: []}
        deadline = time.monotonic() + WAIT_S
        for n in range(1, 1 << 20):
            assert time.monotonic() < deadline, decided
            time.sleep(0.01 if n > 3 else 0)
            out = ranks.step(n)
            for r in (0, 1):
                decided[r].append(sorted(o.request_id for o in out[r].admitted))
            assert decided[0][-1] == decided[1][-1]  # the same requests on the same step
            if n == 3:
                # The gated spec is compiled on rank 0 only: it must wait for rank 1.
                assert not any("q1" in d for d in decided[0])
                ranks.backends[1].gate.set()
            if sum(len(d) for d in decided[0]) == len(SPECS):
                break
        assert sorted(r for d in decided[0] for r in d) == ["q0", "q1", "q2"]
        # The caches hold the same keys, in the same order, on both ranks.
        keys = [list(ranks.managers[r].caches.compiled._items) for r in (0, 1)]
        assert keys[0] == keys[1] and len(keys[0]) == len(SPECS)
    finally:
        ranks.close()


def test_a_sync_request_waits_for_the_warm_compile_it_joins(tmp_path, tiny_tokenizer, managers):
    first = _served_before(tmp_path, tiny_tokenizer, managers, SPECS[:1])
    text = validate_spec(SPECS[0], first.config, vocab="tiny").text
    backend = Counting(tiny_tokenizer, gated={text})
    config = GrammarConfig(compile_mode="sync", store=SpecStoreConfig(dir=str(tmp_path)))
    m = managers(config, tiny_tokenizer, backend)
    assert backend.started.wait(WAIT_S)
    threading.Timer(0.2, backend.gate.set).start()
    out = m.add("r", SPECS[0])  # returns once the warm compile it joined is done
    assert out.cache == "warm" and m.compiled_here("r")
    assert _decide(m, "r").status == "admitted" and backend.total == 1


def test_the_store_in_a_fresh_process_reads_records_written_by_another(tmp_path):
    store = SpecStore(tmp_path, "v", max_records=4, max_spec_bytes=1 << 20)
    assert store.used(b"\x01" * 16, {"regex": "a"})
    assert not store.used(b"\x01" * 16, {"regex": "a"})  # touched again only after a while
    found, refused = SpecStore(tmp_path, "v", max_records=4, max_spec_bytes=1 << 20).load()
    assert refused == [] and [s.spec for s in found] == [{"regex": "a"}]
    found, refused = SpecStore(tmp_path, "w", max_records=4, max_spec_bytes=1 << 20).load()
    assert found == [] and "foreign" in refused[0]
