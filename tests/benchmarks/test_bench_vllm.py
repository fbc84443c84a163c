"""``gramcoord bench vllm`` without an engine: its records' shape, and the skip without vLLM.

The engine run itself is in ``tests/integrations/vllm/test_bench_vllm.py``
(``.venv-vllm``); here the children's JSON is made up, and the main venv
(no vLLM) must skip the benchmark in ``bench all`` rather than fail.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from gramcoord.benchmarks._all import missing_need
from gramcoord.benchmarks._vllm_records import (
    HOL_TARGET,
    PARTS,
    hol_records,
    kernel_autogroup,
    step_records,
)
from gramcoord.launch.cli import main

no_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here"
)


def _step(backend: str, step_ms: float, outputs: list[list[int]]) -> dict:
    parts = {p: [step_ms / 10] * 4 for p in PARTS}
    return {
        "backend": backend,
        "requests": len(outputs),
        "max_tokens": 8,
        "repeat": 1,
        "samples": {
            "constrained": {"step": [step_ms] * 4, "hook": [0.5] * 4, **parts},
            "plain": {"step": [step_ms / 2] * 4, "hook": [0.01] * 4, "forward": [1.0] * 4},
        },
        "outputs": outputs,
        "round_step_ms": {"constrained": [step_ms, step_ms * 2], "plain": [step_ms / 2] * 2},
    }


def _hol_rank(rank: int, fast_ms: float, slow_ms: float, first_ms: float = 0.0) -> dict:
    rounds = [
        {
            "fast_done_ms": fast_ms,
            "fast_first_token_ms": first_ms or fast_ms / 2,
            "slow_done_ms": slow_ms,
            "tokens": {"slow": [1]},
            # (ms from start, step ms, hook ms): one step before the window, two in it.
            "step_log": [[1.0, 50.0, 9.0], [fast_ms - 1, 10.0, 1.0], [fast_ms, 30.0, 3.0]],
            "warmup": w,
        }
        for w in (True, False, False)
    ]
    return {"rank": rank, "backend": "b", "fast": 3, "rounds": rounds}


def test_step_records_compare_backends_and_break_the_step_down() -> None:
    records = step_records(
        _step("xgrammar", 20.0, [[1, 2], [3]]), _step("gramcoord", 16.0, [[1, 2], [4]])
    )
    head = records[0]
    assert (head.name, head.baseline) == ("vllm_engine_step_gramcoord", "vllm_engine_step_xgrammar")
    assert head.target == 1.0 and head.met is True and head.ratio == pytest.approx(1.25)
    assert "identical on 1/2" in head.note
    # Round by round: 20/16 and 40/32.
    assert "per alternated round 1.25, 1.25x, median 1.25x" in head.note
    overhead = records[1]
    assert overhead.name == "vllm_step_grammar_overhead_gramcoord"
    assert (overhead.median_ms, overhead.baseline_median_ms) == (8.0, 10.0)
    plain = {r.name: r for r in records[2:5]}
    assert plain["vllm_step_constrained_gramcoord"].ratio == pytest.approx(0.5)
    # The plain steps of the two engines, side by side.
    both = plain["vllm_step_plain_gramcoord"]
    assert (both.median_ms, both.baseline_median_ms) == (8.0, 10.0)
    assert both.baseline == "vllm_step_plain_xgrammar"
    hooks = {r.name: r for r in records[5:7]}
    assert hooks["vllm_step_hook_plain_gramcoord"].median_ms == pytest.approx(0.01)
    assert hooks["vllm_step_hook_plain_gramcoord"].baseline_median_ms == 8.0
    assert "0.12% of the step time" in hooks["vllm_step_hook_plain_gramcoord"].note
    assert hooks["vllm_step_hook_constrained_gramcoord"].median_ms == pytest.approx(0.5)
    assert all(r.target is None for r in records[1:])
    parts = {r.name for r in records[7:]}
    assert parts == {f"vllm_step_part_{p}_{b}" for p in PARTS for b in ("gramcoord", "xgrammar")}


def test_hol_record_is_the_slowest_rank_median_without_the_warmup() -> None:
    gc = [_hol_rank(0, 900.0, 5000.0), _hol_rank(1, 1000.0, 5100.0)]
    xg = [_hol_rank(0, 6000.0, 6000.0), _hol_rank(1, 5500.0, 5600.0)]
    rec, admitted, decode, step = hol_records(xg, gc)
    assert rec.name == "vllm_tp2_fast_done_gramcoord"
    assert rec.median_ms == 1000.0 and rec.baseline_median_ms == 6000.0
    assert admitted.median_ms == 500.0 and admitted.target is None
    assert rec.target == HOL_TARGET and rec.met is True
    assert "identical across ranks" in rec.note and "2 rounds" in rec.note
    assert "2 shared cores" in rec.note
    # Decode: done minus first token, the slowest rank of each round.
    assert decode.median_ms == 500.0 and decode.baseline_median_ms == 3000.0
    # Steps inside the fast decode window only: 10 and 30 ms on every rank.
    assert step.name == "vllm_tp2_fast_decode_step_gramcoord"
    assert step.median_ms == 20.0 and "median 2.00 ms" in step.note


def test_free_core_records_are_named_apart_and_say_where_things_ran() -> None:
    gc = [_hol_rank(0, 900.0, 5000.0, 100.0), _hol_rank(1, 1000.0, 5100.0, 400.0)]
    xg = [_hol_rank(0, 6000.0, 6000.0), _hol_rank(1, 5500.0, 5600.0)]
    rec, admitted, decode, step = hol_records(xg, gc, free_core=True)
    assert rec.name == "vllm_tp2_fast_done_gramcoord_free_core"
    assert rec.baseline == "vllm_tp2_fast_done_xgrammar_sync_free_core"
    assert rec.target == HOL_TARGET and "CPU 1" in rec.note
    assert admitted.name == "vllm_tp2_fast_admitted_gramcoord_free_core"
    assert decode.name == "vllm_tp2_fast_decode_gramcoord_free_core"
    assert decode.median_ms == 800.0  # max(900 - 100, 1000 - 400)
    assert step.name == "vllm_tp2_fast_decode_step_gramcoord_free_core"
    # The free-core figure says the kernel setting it depends on; the 2-core one does not.
    assert f"kernel autogroup {kernel_autogroup()}" in rec.note
    assert "autogroup" not in hol_records(xg, gc)[0].note


def test_kernel_autogroup_reads_the_sysctl(tmp_path) -> None:
    flag = tmp_path / "sched_autogroup_enabled"
    flag.write_text("1\n")
    assert kernel_autogroup(str(flag)) == "on"
    flag.write_text("0\n")
    assert kernel_autogroup(str(flag)) == "off"
    assert kernel_autogroup(str(tmp_path / "absent")) == "unknown"


def test_the_tp_mask_digests_cost_is_a_share_of_the_steps_that_digest() -> None:
    gc = [_hol_rank(0, 900.0, 5000.0), _hol_rank(1, 1000.0, 5100.0)]
    for rank in gc:
        for rnd in rank["rounds"]:
            # (ms from start, step ms, hook ms, digest ms, rows digested): the first
            # step had no structured rows.
            rnd["step_log"] = [
                [1.0, 50.0, 9.0, 0.002, 0],
                [2.0, 10.0, 1.0, 0.1, 1],
                [3.0, 30.0, 3.0, 0.3, 1],
            ]
    xg = [_hol_rank(0, 6000.0, 6000.0), _hol_rank(1, 5500.0, 5600.0)]
    *_, digest = hol_records(xg, gc)
    assert digest.name == "vllm_tp2_mask_digest_gramcoord"
    assert digest.baseline == "vllm_tp2_engine_step_gramcoord"
    # Steps that digested: 10 and 30 ms, digests 0.1 and 0.3 ms (1% of them).
    assert digest.median_ms == pytest.approx(0.2) and digest.baseline_median_ms == 20.0
    assert digest.target == 50 and digest.met is True
    assert "1.00% of the step time over 8 steps" in digest.note


@no_vllm
def test_bench_vllm_without_vllm_exits_with_a_note(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "vllm", "--out", "unused"])
    assert ".venv-vllm" in str(info.value.code)


@no_vllm
def test_bench_all_skips_vllm_cleanly_without_it(tmp_path, monkeypatch, capsys) -> None:
    assert missing_need("vllm") is not None and missing_need("transport") is None
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert main(["bench", "all", "--out", str(out), "--only", "vllm"]) == 0
    (run,) = json.loads((out / "bench_runs.json").read_text())
    assert run["skipped"].startswith("skipped: vllm is not importable") and run["error"] is None
    assert json.loads((out / "bench.json").read_text()) == []
    assert "vllm skipped" in capsys.readouterr().out
    assert "skipped: vllm" in (out / "bench.md").read_text()


def test_start_runs_abba_and_records_medians_with_pair_ratios() -> None:
    from gramcoord.benchmarks._vllm_start import START_TARGET, order, start_records

    assert order(2) == ["gramcoord", "xgrammar", "xgrammar", "gramcoord"]
    got = {
        "rounds": 3,
        "llm": {"gramcoord": [20.0, 30.0, 22.0], "xgrammar": [20.0, 27.0, 24.0]},
        "server": {"gramcoord": [40.0, 44.0, 41.0], "xgrammar": [44.0, 40.0, 41.0]},
    }
    llm, server = start_records(got)
    assert (llm.name, llm.baseline) == ("vllm_start_llm_gramcoord", "vllm_start_llm_xgrammar")
    assert (llm.median_ms, llm.baseline_median_ms) == (22_000.0, 24_000.0)
    assert llm.target == START_TARGET == 0.909 and llm.met
    assert "pair ratios xgrammar/gramcoord: 1.000, 0.900, 1.091" in llm.note
    assert "VLLM_PLUGINS=''" in llm.note
    assert server.name == "vllm_start_server_gramcoord" and server.ratio == 1.0


def test_start_baseline_loads_no_plugin(tmp_path, monkeypatch) -> None:
    from gramcoord.benchmarks._vllm_start import child_env

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    ours, base = child_env("gramcoord", tmp_path), child_env("xgrammar", tmp_path)
    assert "VLLM_PLUGINS" not in ours and base["VLLM_PLUGINS"] == ""
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in ours  # vLLM's default engine process
    assert ours["VLLM_CACHE_ROOT"] == str(tmp_path)
