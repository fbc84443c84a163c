"""Session fixtures shared by every test package."""

from __future__ import annotations

import json
import secrets
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import xgrammar as xgr
from hypothesis import HealthCheck, settings

from gramcoord.launch.workload import dev_data_dir
from gramcoord.rank_worker.config import TokenizerConfig
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer, load_tokenizer
from gramcoord.sync.janitor import remove
from tests import dev_data, load
from tests.sync.transport_peers import ipc_dirs, shm_names

# No property test passes or fails on speed: no per-example deadline, and
# no health check that times input generation (a loaded machine trips it).
settings.register_profile("gramcoord", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("gramcoord")

# A suite started in the background (`cmd &`, nohup) inherits SIGINT ignored,
# and Python then never raises KeyboardInterrupt. The Ctrl-C tests send real
# SIGINTs to this process and to the runs it starts (which inherit the
# disposition): give both Python's own handler, as a terminal would.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The longest modules, longest first. `make test` runs `-n 2 --dist loadscope`:
# xdist hands out modules most tests first by default, which leaves these
# (few tests, each a multi-process run) for last, where one worker runs them
# in a row while the other idles. Handed out first (pytest_configure turns
# xdist's reordering off), the many short modules fill in at the end.
SLOW_MODULES = (
    "tests/launch/test_resume.py",
    "tests/launch/test_cross_host_faults.py",
    "tests/launch/test_faults.py",
    "tests/launch/test_e2e.py",
    "tests/launch/test_soak.py",
    "tests/launch/test_cross_host_transport.py",
    "tests/launch/test_progress.py",
    "tests/launch/test_launchers.py",
    "tests/launch/test_hostile_run.py",
    "tests/coordinator/test_spawn.py",
    "tests/launch/test_ray_cluster.py",
    "tests/launch/test_two_hosts.py",
    "tests/coordinator/test_two_level_hosts.py",
    "tests/rank_worker/grammars/test_dev_schemas.py",
)


def pytest_configure(config):
    # xdist's "most tests first" order would undo SLOW_MODULES (loadscope only).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """SLOW_MODULES first, in that order; every other module after them, as collected."""
    first = {path: i for i, path in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: first.get(item.nodeid.partition("::")[0], len(first)))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item):
    """pytest-timeout's limit of each test grows with the load (``tests/load.py``).

    Runs before pytest-timeout reads the limit: the test's own ``timeout``
    marker, else ``--timeout`` / the ini's, is put back multiplied by the
    factor measured now (kept in ``user_properties`` as ``load_factor``).
    """
    marker = item.get_closest_marker("timeout")
    args, kwargs = (list(marker.args), dict(marker.kwargs)) if marker is not None else ([], {})
    if args:
        base = args.pop(0)
    elif "timeout" in kwargs:
        base = kwargs.pop("timeout")
    else:
        base = item.config.getoption("timeout", None) or item.config.getini("timeout")
    if base and float(base) > 0:
        f = load.factor()
        item.user_properties.append(("load_factor", f))
        item.add_marker(pytest.mark.timeout(float(base) * f, *args, **kwargs), append=False)
    yield


# $GRAMCOORD_DATA_DIR, else the full set in ../shared/data when it is there,
# else the repo's own subset in tests/data (tests/data/README.md).
DATA: Path = dev_data_dir()


def make_tiny_tokenizer() -> Tokenizer:
    """256 single bytes, a few multi-byte pieces, one stop and one special."""
    pieces = [bytes([i]) for i in range(256)] + [b'{"', b'":', b'"}', b"true", b"  "]
    token_bytes = [*pieces, b"</s>", b"<tool>"]
    stop = len(pieces)
    return Tokenizer(
        name="tiny",
        token_bytes=token_bytes,
        special_ids={"</s>": stop, "<tool>": stop + 1},
        stop_ids=(stop,),
        encoder=lambda text: list(text.encode("utf-8")),
    )


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Tokenizer:
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def qwen_tokenizer() -> Tokenizer:
    return load_tokenizer(TokenizerConfig(name="qwen2.5"))


@pytest.fixture(scope="session")
def dev_schemas() -> list[dict]:
    """Dev schema records, each with its xgrammar label under ``"label"``."""
    labels = {}
    for line in (DATA / "schemas-dev.xgrammar-labels.jsonl").read_text().splitlines():
        rec = json.loads(line)
        labels[rec["id"]] = rec
    out = dev_data.records()
    for rec in out:
        rec["label"] = labels.get(rec["id"], {})
    return out


@pytest.fixture
def run_id() -> str:
    """A run id unique to this test; every segment the test makes carries it.

    After the test, anything of this run left in /dev/shm or the temp dir is
    removed and reported as a leak.
    """
    rid = f"t{secrets.token_hex(5)}"
    yield rid
    # A killed child's reaper removes its names a moment after the kill.
    deadline = time.monotonic() + 5
    while (shm_names(rid) or ipc_dirs(rid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    leaked = [("shm", n) for n in shm_names(rid)] + [("dir", d) for d in ipc_dirs(rid)]
    for kind, name in leaked:
        remove(kind, name)
    assert not leaked, f"transport leaked {leaked}"


# Dev schemas used by the property tests: small, fast to compile, with a
# valid instance xgrammar accepts as ``json.dumps`` text.
_POOL_SIZE = 24
_MAX_SCHEMA_BYTES = 1500
_MAX_LABEL_COMPILE_MS = 15.0


@pytest.fixture(scope="session")
def compile_json() -> Callable[..., xgr.CompiledGrammar]:
    """``compile_json(tokenizer, schema, any_whitespace=True)``, cached."""
    compilers: dict[int, xgr.GrammarCompiler] = {}
    cache: dict[tuple, xgr.CompiledGrammar] = {}

    def compile_(tokenizer: Tokenizer, schema, *, any_whitespace: bool = True):
        key = (id(tokenizer), json.dumps(schema, sort_keys=True), any_whitespace)
        if key not in cache:
            if id(tokenizer) not in compilers:
                compilers[id(tokenizer)] = xgr.GrammarCompiler(tokenizer.info, max_threads=1)
            cache[key] = compilers[id(tokenizer)].compile_json_schema(
                schema, any_whitespace=any_whitespace
            )
        return cache[key]

    return compile_


def instance_text(data, any_whitespace: bool) -> str:
    # xgrammar's separators: compact with any_whitespace, ", " / ": " without.
    return json.dumps(data) if not any_whitespace else json.dumps(data, separators=(",", ":"))


@pytest.fixture(scope="session")
def dev_pool(dev_schemas, qwen_tokenizer, compile_json) -> dict[bool, list[tuple]]:
    """any_whitespace -> [(schema id, compiled grammar, instance text)]."""
    candidates = [
        rec
        for rec in dev_schemas
        if rec["label"].get("status") == "ok"
        and rec["label"].get("compile_ms", 1e9) <= _MAX_LABEL_COMPILE_MS
        and rec["size_bytes"] <= _MAX_SCHEMA_BYTES
        and any(inst["valid"] for inst in rec["instances"])
    ]
    pool: dict[bool, list[tuple]] = {True: [], False: []}
    for any_ws in (True, False):
        for rec in candidates:
            if len(pool[any_ws]) >= _POOL_SIZE:
                break
            data = next(inst["data"] for inst in rec["instances"] if inst["valid"])
            text = instance_text(data, any_ws)
            try:
                compiled = compile_json(qwen_tokenizer, rec["schema"], any_whitespace=any_ws)
            except Exception:
                continue
            matcher = xgr.GrammarMatcher(compiled)
            if matcher.accept_string(text) and matcher.is_completed():
                pool[any_ws].append((rec["id"], compiled, text))
    assert len(pool[True]) >= 10 and len(pool[False]) >= 10, "too few usable dev schemas"
    return pool
