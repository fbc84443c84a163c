"""The fast side of ``gramcoord run`` / ``verify``: refusals before any process, packaging.

Nothing here starts a rank: a bad config or bad inputs must be refused with
exit status 2 (and the field's path) before the launcher is ever called.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gramcoord.launch.run as run_mod
from gramcoord.launch import rank_main
from gramcoord.launch.cli import main
from tests.launch.e2e_support import CONFIGS, ROOT, LeakGuard, squash, write_workload
from tests.launch.entries import descendants
from tests.load import scaled


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything tries to start the ranks."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("a rank was launched")

    monkeypatch.setattr(run_mod, "launch", refuse)
    before = descendants()
    yield calls
    assert calls == []
    assert descendants() - before == set()


@pytest.fixture
def workload(tmp_path):
    return write_workload(tmp_path / "w.jsonl", ["gramcoord/choice/sentiment"])


BAD_CONFIGS = [
    pytest.param("parallel: {dp: 2\n", [], "not valid YAML", id="yaml-syntax"),
    pytest.param("parallel: {dp: two}\n", [], "$.parallel.dp", id="wrong-type"),
    pytest.param("parallel: {dp: 2, dpp: 3}\n", [], "dpp", id="unknown-field"),
    pytest.param("paralel: {dp: 2}\n", [], "paralel", id="unknown-section"),
    pytest.param("launcher: torchrun\n", ["parallel.dp=two"], "$.parallel.dp", id="override-type"),
    pytest.param(
        "launcher: inline\nparallel: {dp: 2}\n", [], "launcher 'inline'", id="cross-field"
    ),
]


@pytest.mark.parametrize("command", ["run", "verify"])
@pytest.mark.parametrize(("yaml_text", "overrides", "needle"), BAD_CONFIGS)
def test_bad_config_exits_2_naming_the_field(
    tmp_path, workload, capsys, no_launch, command, yaml_text, overrides, needle
):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml_text)
    argv = [command, str(cfg), "--workload", str(workload), "--out", str(tmp_path / "out")]
    for item in overrides:
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "config error" in err and needle in err, err
    assert str(cfg) in err or overrides
    assert not (tmp_path / "out").exists()


def test_unknown_field_message_names_its_section(tmp_path, workload, capsys, no_launch):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("parallel: {dp: 2, dpp: 3}\n")
    assert main(["run", str(cfg), "--workload", str(workload)]) == 2
    err = capsys.readouterr().err
    assert "$.parallel" in err and "dpp" in err, err


@pytest.mark.parametrize(("yaml_text", "overrides", "needle"), BAD_CONFIGS)
def test_rank_main_refuses_a_bad_config_with_2(tmp_path, capsys, yaml_text, overrides, needle):
    """The per-rank program under the user's torchrun: same check, same status."""
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml_text)
    argv = [str(cfg), "--out", str(tmp_path / "out")]
    for item in overrides:
        argv += ["--set", item]
    before = descendants()
    assert rank_main.main(argv) == 2
    assert needle in capsys.readouterr().err
    assert descendants() - before == set()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["run", "verify"])
@pytest.mark.parametrize(
    ("overrides", "workload_name", "needle"),
    [
        pytest.param([], "missing.jsonl", "not found", id="missing-workload"),
        pytest.param(
            ["model.kind=hf", "model.path=/nonexistent/model"],
            None,
            "is not a directory",
            id="missing-model",
        ),
        pytest.param(["launcher=external"], None, "gramcoord.launch.rank_main", id="external"),
    ],
)
def test_bad_inputs_exit_2_before_any_process(
    tmp_path, workload, capsys, no_launch, monkeypatch, command, overrides, workload_name, needle
):
    monkeypatch.setenv("COLUMNS", "1000")
    path = tmp_path / workload_name if workload_name else workload
    argv = [command, str(CONFIGS / "local.yaml"), "--workload", str(path)]
    argv += ["--out", str(tmp_path / "out")]
    for item in overrides:
        argv += ["--set", item]
    assert main(argv) == 2
    # The CLI's own checks write to stderr, the run's pre-start checks to
    # the console: the line must be in one of them.
    captured = capsys.readouterr()
    out = squash(captured.out + captured.err)
    assert needle in out, out
    assert not (tmp_path / "out").exists()


def test_shipped_configs_name_their_launcher():
    """Each multi-rank config the e2e tests use starts the topology they assume."""
    from gramcoord.launch.config import load_config

    expect = {
        "local.yaml": ("torchrun", 2, 1, 2),
        "pp.yaml": ("torchrun", 1, 2, 2),
        "replicated.yaml": ("torchrun", 2, 1, 1),
        "ray.yaml": ("ray", 2, 1, 1),
        "external-launcher.yaml": ("external", 2, 1, 1),
    }
    for name, want in expect.items():
        c = load_config(CONFIGS / name)
        assert (c.launcher, c.parallel.dp, c.parallel.pp, c.parallel.tp) == want, name


# -- packaging ------------------------------------------------------------------

# Installed subpackage of `gramcoord` -> the folder it is built from.
_PACKAGES = {
    "coordinator": "coordinator",
    "engine": "engine",
    "rank_worker": "rank_worker",
    "sync": "sync",
    "launch": "launch",
    "benchmarks": "benchmarks",
    "configs": "configs",
    "dev_data": "tests/data",
    "integrations": "integrations",
}
# Data files that must travel with the package (`gramcoord bench`, the
# default config run), licences included.
_DATA = {
    "configs": ("local.yaml", "workload.jsonl", "LICENSES/Apache-2.0.txt"),
    "dev_data": (
        "schemas-dev.jsonl",
        "schemas-dev.xgrammar-labels.jsonl",
        "README.md",
        "LICENSES/Apache-2.0.txt",
        "LICENSES/MIT-JSON-Schema-Test-Suite.txt",
    ),
}
_TOP_LEVEL = str(tuple(_PACKAGES))


def _copy_sources(dst: Path) -> Path:
    """The files a build reads, copied, so the build never writes into the checkout."""
    import shutil

    dst.mkdir()
    for name in ("pyproject.toml", "README.md", *_PACKAGES.values()):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst / name)
    return dst


def _pip_install_target(src: Path, target: Path) -> subprocess.CompletedProcess:
    base = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
    args = ["--target", str(target), str(src)]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    # With this venv's setuptools: no index needed.
    proc = subprocess.run(
        [*base, "--no-build-isolation", "--no-index", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=scaled(240),
    )
    if proc.returncode != 0:  # e.g. no setuptools here: an isolated build fetches it
        proc = subprocess.run(
            [*base, *args], capture_output=True, text=True, env=env, timeout=scaled(240)
        )
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A ``pip install --target`` of a copy of the sources (one per module)."""
    tmp = tmp_path_factory.mktemp("pip")
    target = tmp / "target"
    proc = _pip_install_target(_copy_sources(tmp / "src"), target)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target


def _run_installed(target: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """Run this Python with only the target install on PYTHONPATH, away from the checkout."""
    env = {k: v for k, v in os.environ.items() if k != "GRAMCOORD_DATA_DIR"}
    return subprocess.run(
        [sys.executable, *argv],
        cwd=cwd,
        env={**env, "PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )


@pytest.mark.timeout(300)
def test_pip_install_adds_exactly_one_top_level_name(installed, tmp_path):
    target = installed
    top = sorted(p.name for p in target.iterdir())
    extra = [n for n in top if n not in ("gramcoord", "bin") and not n.endswith(".dist-info")]
    assert extra == [], top
    assert "gramcoord" in top and sum(n.endswith(".dist-info") for n in top) == 1, top
    # `gramcoord` is a namespace package holding exactly the subpackages,
    # each with every module of its source folder, and the data they read.
    pkg = target / "gramcoord"
    assert not (pkg / "__init__.py").exists()
    assert sorted(p.name for p in pkg.iterdir()) == sorted(_PACKAGES)
    for sub, folder in _PACKAGES.items():
        # The data folders' subfolders are licences, or test fixtures that stay out.
        find = Path.glob if sub in _DATA else Path.rglob
        have = {p.relative_to(pkg / sub) for p in find(pkg / sub, "*.py")}
        want = {p.relative_to(ROOT / folder) for p in find(ROOT / folder, "*.py")}
        assert have == want, (sub, want ^ have)
    for sub, names in _DATA.items():
        for name in names:
            shipped, source = pkg / sub / name, ROOT / _PACKAGES[sub] / name
            assert shipped.read_bytes() == source.read_bytes(), shipped
    # The installed copy imports from the target, as `gramcoord.*` only.
    code = (
        "import importlib.util as u, gramcoord.launch.cli as c, gramcoord.benchmarks.agreement;"
        "print(c.__file__);"
        f"print([n for n in {_TOP_LEVEL} if u.find_spec(n)])"
    )
    run = _run_installed(target, tmp_path, "-c", code)
    assert run.returncode == 0, run.stderr
    path, names = run.stdout.splitlines()
    assert Path(path).is_relative_to(target) and names == "[]", run.stdout


@pytest.mark.timeout(300)
def test_bench_runs_from_the_installed_package(installed, tmp_path):
    """No checkout on the path: the benchmarks, their data and the default config
    come from the install."""
    code = (
        "from gramcoord.benchmarks._contract import available, installed_data_dir, load, package_dir;"
        "print(load('transport').__file__);"
        "print(installed_data_dir());"
        "print(package_dir('gramcoord.configs', 'local.yaml') / 'local.yaml');"
        "print(load('journal').WORKLOAD);"
        "print(','.join(available()))"
    )
    run = _run_installed(installed, tmp_path, "-c", code)
    assert run.returncode == 0, run.stderr
    module, data, config, workload, names = run.stdout.splitlines()
    pkg = installed / "gramcoord"
    assert Path(module) == pkg / "benchmarks" / "transport.py"
    assert Path(data) == pkg / "dev_data"
    assert Path(config) == pkg / "configs" / "local.yaml"
    # A benchmark that finds the workload beside itself finds the installed one.
    assert Path(workload).resolve() == (pkg / "configs" / "workload.jsonl").resolve()
    assert {"agreement", "compile", "fill", "journal", "transport"} <= set(names.split(","))
    out = tmp_path / "out"
    argv = ["-m", "gramcoord.launch.cli", "bench", "transport", "--out", str(out)]
    tiny = ["--iters", "3", "--warmup", "1", "--rounds", "1", "--rows", "8"]
    run = _run_installed(installed, tmp_path, *argv, "--", *tiny)
    assert run.returncode == 0, run.stdout + run.stderr
    records = json.loads((out / "bench.json").read_text())
    assert records and {r["bench"] for r in records} == {"transport"}


def test_editable_install_exposes_only_gramcoord(tmp_path):
    """Outside the checkout, the generic folder names are not importable."""
    code = (
        "import importlib.util as u, gramcoord.launch.cli as c, gramcoord.engine.loop;"
        "print(c.__file__);"
        f"print([n for n in {_TOP_LEVEL} if u.find_spec(n)])"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert run.returncode == 0, run.stderr
    path, names = run.stdout.splitlines()
    assert Path(path).resolve() == (ROOT / "launch" / "cli.py").resolve()
    assert names == "[]", run.stdout


# -- the e2e tests' leak guard guards ----------------------------------------------


def test_leak_guard_sees_a_left_process_and_segment():
    guard = LeakGuard()
    proc = subprocess.Popen(["sleep", "60"])
    seg = Path("/dev/shm") / f"gramcoord-guardtest-x-{os.getpid()}-0123abcd"
    seg.write_bytes(b"x")
    try:
        with pytest.raises(AssertionError, match="processes left behind"):
            guard.check(timeout=0.3)
        proc.kill()
        proc.wait()
        with pytest.raises(AssertionError, match=seg.name):
            guard.check(timeout=0.3)
    finally:
        proc.kill()
        proc.wait()
        seg.unlink(missing_ok=True)
    guard.check(timeout=0.3)


# -- hostile records never end a run ------------------------------------------------------


def test_hostile_records_fail_alone_and_the_run_completes(tmp_path, capfd):
    """A lone-surrogate id or spec, a repeated id and a schema jsonschema cannot use."""
    lines = [
        r'{"id": "ok-1", "structured_outputs": {"choice": ["yes", "no"]}, "max_tokens": 8}',
        r'{"id": "bad-\ud800", "structured_outputs": {"choice": ["a", "b"]}, "max_tokens": 8}',
        r'{"id": "ok-1", "structured_outputs": {"regex": "[0-9]{3}"}, "max_tokens": 8}',
        r'{"id": "odd-schema", "structured_outputs": {"json": {"type": "object",'
        r' "dependentRequired": 5}}, "max_tokens": 16}',
        r'{"id": "spec-\u00e9", "structured_outputs": {"choice": ["x\ud800"]}, "max_tokens": 8}',
    ]
    wl = tmp_path / "hostile.jsonl"
    wl.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    rc = main(
        [
            "run",
            str(CONFIGS / "local.yaml"),
            "--workload",
            str(wl),
            "--out",
            str(out),
            "--set",
            "launcher=inline",
            "--set",
            "parallel.dp=1",
            "--set",
            "parallel.tp=1",
        ]
    )
    assert rc == 0, capfd.readouterr()
    import json

    recs = [json.loads(x) for x in (out / "outputs.jsonl").read_text().splitlines()]
    by_id = {r["id"]: r for r in recs}
    assert len(recs) == len(lines)
    assert by_id["ok-1"]["status"] == "ok"
    assert by_id["bad-\\ud800"]["error"]["code"] == "record_invalid"
    # Renamed after its 1-based line; the message names the first one's.
    assert by_id["ok-1@line3"]["error"]["code"] == "record_invalid"
    assert "repeats line 1" in by_id["ok-1@line3"]["error"]["message"]
    assert by_id["spec-é"]["error"]["code"] == "spec_bad_json"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["json_valid"]["unverifiable"] == 1


def test_a_second_run_on_a_spec_store_compiles_nothing_on_the_request_path(tmp_path, capfd):
    """``gramcoord run`` with ``grammar.store``: the first run keeps its specs; the next
    compiles them at start, and each of its requests joins that compile."""
    import json

    lines = [
        '{"id": "a", "structured_outputs": {"choice": ["yes", "no"]}, "max_tokens": 8}',
        '{"id": "b", "structured_outputs": {"regex": "[0-9]{3}"}, "max_tokens": 8}',
        '{"id": "c", "structured_outputs": {"json": {"type": "object", "properties":'
        ' {"n": {"type": "integer"}}, "required": ["n"]}}, "max_tokens": 16}',
    ]
    wl = tmp_path / "wl.jsonl"
    wl.write_text("\n".join(lines) + "\n")
    store = tmp_path / "store"
    outputs = []
    for name in ("first", "again"):
        out = tmp_path / name
        argv = ["run", str(CONFIGS / "local.yaml"), "--workload", str(wl), "--out", str(out)]
        for item in (
            "launcher=inline",
            "parallel.dp=1",
            "parallel.tp=1",
            f"grammar.store.dir={store}",
            "grammar.store.ready_wait_s=120",
        ):
            argv += ["--set", item]
        assert main(argv) == 0, capfd.readouterr()
        cache = json.loads((out / "summary.json").read_text())["cache"]
        recs = (out / "outputs.jsonl").read_text().splitlines()
        outputs.append(sorted(json.loads(r)["token_ids"] for r in recs))
        caches = sorted(json.loads(r)["cache"] for r in recs)
        if name == "first":
            assert cache["misses"] == 3 and cache["warm"] == 0, cache
            assert len(list((store / "specs").glob("*.json"))) == 3
        else:
            assert cache["warm"] == 3 and cache["misses"] == 0, cache
            assert caches == ["warm"] * 3  # each output record says so
    assert outputs[0] == outputs[1]  # the same outputs, warm or not


# -- an NCCL config on a machine that cannot run it -----------------------------------------


@pytest.mark.parametrize(
    ("devices", "needle"),
    [
        pytest.param((True, 0), "(0 visible here)", id="no-gpu"),
        pytest.param((True, 2), "(2 visible here)", id="too-few"),
        pytest.param((False, 8), "built without NCCL", id="no-nccl"),
    ],
)
def test_nccl_config_without_gpus_exits_2_in_one_line(
    tmp_path, workload, capsys, no_launch, monkeypatch, devices, needle
):
    """Checked before any rank starts; the probe is stubbed, so no GPU is needed
    (and a machine with GPUs gets the same answer)."""
    import gramcoord.launch.failures as failures

    monkeypatch.setattr(failures, "cuda_devices", lambda: devices)
    monkeypatch.setenv("COLUMNS", "1000")
    for command in ("run", "verify"):
        argv = [command, str(CONFIGS / "gpu-node.yaml"), "--workload", str(workload)]
        assert main([*argv, "--out", str(tmp_path / "out")]) == 2
        out = capsys.readouterr().out
        lines = [ln for ln in out.splitlines() if ln.strip()]
        assert len(lines) == 1 and "Traceback" not in out, out
        assert "'nccl' needs CUDA GPUs" in out and "8 rank(s) on this machine" in out, out
        assert needle in out, out
    assert not (tmp_path / "out").exists()
    # Under the user's own torchrun: the node's ranks, same status.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    argv = [str(CONFIGS / "gpu-node.yaml"), "--workload", str(workload)]
    assert rank_main.main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "4 rank(s) on this machine" in err and needle in err, err


def test_nccl_precheck_passes_with_enough_gpus(monkeypatch):
    import gramcoord.launch.failures as failures
    from gramcoord.launch.config import load_config

    config = load_config(CONFIGS / "gpu-node.yaml")
    monkeypatch.setattr(failures, "cuda_devices", lambda: (True, 8))
    assert failures.backend_problem(config) is None
    assert failures.backend_problem(load_config(CONFIGS / "local.yaml")) is None
    monkeypatch.setattr(failures, "cuda_devices", lambda: (True, 4))
    # Two nodes of four ranks each fit four GPUs per node.
    two_nodes = load_config(CONFIGS / "gpu-node.yaml", ["distributed.nnodes=2"])
    assert failures.backend_problem(two_nodes) is None


def test_the_real_probe_answers_without_a_gpu():
    from gramcoord.launch.failures import cuda_devices

    nccl, count = cuda_devices()
    assert isinstance(nccl, bool) and count >= 0


def test_a_badly_shaped_workload_fails_the_run_before_any_rank(tmp_path, monkeypatch, capsys):
    """From another folder: --workload is taken from the working directory, and
    a record's shape (here a typo and a bad max_tokens) fails the run with exit 2."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w.jsonl").write_text(
        '{"id": "a", "structured_output": {"regex": "a"}}\n{"id": "b", "prompt": "x", '
        '"max_tokens": "lots"}\n'
    )
    started = []
    monkeypatch.setattr("gramcoord.launch.run.launch", lambda *a, **k: started.append(a))
    rc = main(["run", str(CONFIGS / "local.yaml"), "--workload", "w.jsonl", "--out", "out"])
    assert rc == 2 and started == []
    err = capsys.readouterr().err
    assert f"{tmp_path / 'w.jsonl'}:1: $.structured_output: unknown field" in err
    assert f"{tmp_path / 'w.jsonl'}:2: $.max_tokens: expected `int`" in err
    assert not (tmp_path / "out").exists()
