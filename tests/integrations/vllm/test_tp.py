"""TP=2 under ``external_launcher`` (torchrun): async compile, same admissions on every rank,
and masks proven identical across the ranks (a flipped bit on one rank is caught and named)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.integrations.vllm.conftest import fast_schemas, schema
from tests.integrations.vllm.test_engine import PROMPT, _params, _run
from tests.integrations.vllm.tiny_model import vllm_cpu_shm
from tests.load import scaled
from tests.procs import torchrun_command

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[3]
# Compiles for seconds with the Qwen2.5 vocabulary; the driver also holds its
# compile until the fast requests have finished (or 240 s passed), so that
# the engine's first-step warm-up (inductor compiles xgrammar's CPU mask
# kernel, about 12 s here) cannot hide a held-up fast request.
SLOW_ID = "kode-ci-build-1.0"
SLOW_MARK = "app-center-release"  # in the slow schema's text only
FAULT = {
    "type": "object",
    "properties": {"fault_me": {"type": "integer"}},
    "required": ["fault_me"],
}


# Rank 1 clears one allowed token of this request's row at output position 2.
FLIP = "1:flip:2"
# Long enough (no EOS) that the mismatch, found within two digest windows of
# 8 steps, is found while the request still runs.
FLIP_TOKENS = 40


def _requests() -> list[list[dict[str, Any]]]:
    fast = fast_schemas()
    first = [{"id": "slow", "schema": schema(SLOW_ID), "max_tokens": 16}]
    first += [{"id": f"fast{i}", "schema": fast[i], "max_tokens": 16} for i in range(6)]
    second = [{"id": f"after{i}", "schema": fast[6 + i], "max_tokens": 8} for i in range(3)]
    second.insert(1, {"id": "fault", "schema": FAULT, "max_tokens": 8})
    third = [
        {"id": rid, "schema": fast[9 + i], "max_tokens": FLIP_TOKENS, "ignore_eos": True}
        for i, rid in enumerate(("beside0", "flip", "beside1"))
    ]
    for batch in (first, second, third):
        for r in batch:
            r["prompt"] = PROMPT
    return [first, second, third]


def _store_the_after_batch(model: Path, root: Path) -> None:
    """A spec store holding the second batch's fast schemas, as a served engine keeps them."""
    from gramcoord.benchmarks._vllm_common import VOCAB_SIZE
    from gramcoord.integrations.vllm.options import vllm_grammar_config
    from gramcoord.rank_worker.grammars.spec import validate_spec
    from gramcoord.rank_worker.grammars.spec_store import SpecStore

    vocab = f"vllm:{model}:{VOCAB_SIZE}"
    store = SpecStore(root, vocab, max_records=16, max_spec_bytes=1 << 20)
    config = vllm_grammar_config(False)
    for r in _requests()[1]:
        if r["id"].startswith("after"):
            raw = {"json": json.dumps(r["schema"])}  # vLLM's key of a schema object
            assert store.used(validate_spec(raw, config, vocab=vocab).key, raw)


@pytest.fixture(scope="module")
def tp_out(tiny_model, tmp_path_factory) -> Path:
    """The directory of one torchrun TP=2 run's per-rank results."""
    out = tmp_path_factory.mktemp("tp")
    requests = out / "requests.json"
    requests.write_text(json.dumps(_requests()))
    _store_the_after_batch(tiny_model, out / "store")
    env = {
        **os.environ,
        "STORE_DIR": str(out / "store"),
        "FAIL_MARK": "1:fault_me",
        "GATE_MARK": SLOW_MARK,
        "FLIP": FLIP,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = torchrun_command(
        Path(__file__).with_name("tp_driver.py"),
        str(tiny_model),
        str(requests),
        str(out),
        log_dir=out / "torchrun",
        tee=True,  # the test reads each rank's log
    )
    with vllm_cpu_shm():
        proc = subprocess.run(
            cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=scaled(800)
        )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return out


@pytest.fixture(scope="module")
def tp_run(tp_out) -> dict[int, dict[str, Any]]:
    return {r: json.loads((tp_out / f"rank{r}.json").read_text()) for r in (0, 1)}


@pytest.fixture(scope="module")
def tp_times(tp_out) -> dict[int, dict[str, float]]:
    return {r: json.loads((tp_out / f"rank{r}.times.json").read_text()) for r in (0, 1)}


def test_both_ranks_agree_and_keep_compiles_async(tp_run) -> None:
    r0, r1 = tp_run[0], tp_run[1]
    # Tokens, finish reasons and the step each request finished in; the flipped
    # request's tokens may differ (rank 1 sampled under another mask).
    assert {k: v for k, v in r0.items() if k != "flip"} == {
        k: v for k, v in r1.items() if k != "flip"
    }
    stats = r0["_stats"]
    assert stats["group_size"] == 2 and stats["async"] and stats["num_live"] == 0
    assert stats["collectives"] > 0
    fast = [r0[f"fast{i}"] for i in range(6)]
    assert all(f["reason"] in ("stop", "length") for f in fast)
    assert r0["slow"]["reason"] in ("stop", "length")


def test_both_ranks_warm_the_stored_specs_and_decide_alike(tp_run) -> None:
    """Each rank compiled the stored schemas at start; their requests joined those
    compiles on both ranks, and were admitted on the same step."""
    for rank in (0, 1):
        assert tp_run[rank]["_stats"]["warm"] == 3, tp_run[rank]["_stats"]
    for i in range(3):
        assert tp_run[0][f"after{i}"] == tp_run[1][f"after{i}"]


def test_the_slow_compile_holds_nobody_up(tp_run, tp_times) -> None:
    """The fast requests finish while the slow compile is still held (no rank waits on it)."""
    for rank in (0, 1):
        assert not tp_times[rank]["gate_timed_out"], tp_times[rank]
    r0 = tp_run[0]
    fast = [r0[f"fast{i}"] for i in range(6)]
    assert max(f["step"] for f in fast) < r0["slow"]["first_step"], r0


def test_a_compile_failing_on_one_rank_fails_on_both(tp_run) -> None:
    for rank in (0, 1):
        got = tp_run[rank]
        assert got["fault"]["reason"] == "error"
        assert got["fault"]["tokens"] == []
        assert all(got[f"after{i}"]["reason"] in ("stop", "length") for i in range(3))


def test_a_mask_divergence_on_one_tp_rank_is_caught_and_named(tp_run, tp_times, tp_out) -> None:
    """Rank 1's row of ``flip`` lost a token: both ranks fail ``flip`` alike, the rest run on."""
    assert tp_times[1]["flipped"] and not tp_times[0]["flipped"]
    mismatches = tp_run[0]["_stats"]["mismatches"]
    assert mismatches == tp_run[1]["_stats"]["mismatches"]
    # The first names the flipped row; a later window may find ``flip`` again
    # (rank 1 may have sampled another token), never another request.
    assert mismatches and all(m[2] == "flip" for m in mismatches), mismatches
    step, ranks, request_id, position = mismatches[0]
    assert (ranks, request_id, position) == ([1], "flip", 2)
    assert tp_run[0]["_stats"]["digested_steps"] == tp_run[1]["_stats"]["digested_steps"] > step
    for rank in (0, 1):
        got = tp_run[rank]
        assert got["flip"]["reason"] == "error"
        assert got["flip"]["stop_reason"].startswith(
            f"gramcoord tp_mask_mismatch: step {step}: TP ranks [1] "
        ), got["flip"]
        assert len(got["flip"]["tokens"]) < FLIP_TOKENS
        for rid in ("beside0", "beside1"):
            assert got[rid]["reason"] == "length" and len(got[rid]["tokens"]) == FLIP_TOKENS
    # Each rank's log has the error line naming the request, the code, the step and the ranks.
    line = re.compile(rf"request flip-\w+ failed: tp_mask_mismatch: step {step}: TP ranks \[1\] ")
    for rank in (0, 1):
        logs = [
            p.read_text(errors="replace") for p in (tp_out / "torchrun").rglob(f"{rank}/std*.log")
        ]
        assert any(line.search(text) for text in logs), (rank, [t[-2000:] for t in logs])


def test_tp_outputs_equal_the_one_process_run(tp_run, engines) -> None:
    llm = engines.get("gramcoord")
    batches = _requests()
    for batch in batches:
        kept = [r for r in batch if r["id"] not in ("fault", "flip")]
        params = [
            _params(r["schema"], max_tokens=r["max_tokens"], ignore_eos=r.get("ignore_eos", False))
            for r in kept
        ]
        got = _run(llm, params)
        for r, (tokens, reason) in zip(kept, got):
            assert tp_run[0][r["id"]]["tokens"] == tokens, r["id"]
            assert tp_run[0][r["id"]]["reason"] == reason, r["id"]


# Packages a vLLM engine process never runs: our transport (vLLM moves its own
# masks), our engine and launchers, the benchmarks, the other hosts' plugins,
# our mask builder (vLLM fills masks with its own matcher), and our
# vocabularies (vLLM's tokenizer is named by a HostVocabulary).
NEVER_LOADED = (
    "gramcoord.sync",
    "gramcoord.engine",
    "gramcoord.launch",
    "gramcoord.benchmarks",
    "gramcoord.integrations.sglang",
    "gramcoord.integrations.hf",
    "gramcoord.rank_worker.masks",
    "gramcoord.rank_worker.grammars.tokenizer",
)
# Our modules (packages included) a TP=2 external-launcher rank holds after
# its requests: the plugin, the grammar manager and its validation, the
# stage leader with the agreement, the TP mask digests, and the spec store
# this run uses; never the chain of a pipeline, the two-level agreement, the
# poison sharing of DP replicas, or fault injection (no faults section).
MAX_MODULES_TP2 = 39
NOT_RUN_AT_TP2 = (
    "gramcoord.coordinator.pipeline",
    "gramcoord.coordinator.poison_share",
    "gramcoord.coordinator.two_level",
    "gramcoord.integrations.vllm.replicas",
    "gramcoord.rank_worker.faults",
)


def test_a_vllm_rank_loads_only_what_it_runs(tp_run, tp_out) -> None:
    for rank in (0, 1):
        loaded = json.loads((tp_out / f"rank{rank}.modules.json").read_text())
        # What the driver imported itself before the engine (its engine
        # arguments) is the test's, not the engine's.
        harness = {m for m in loaded["harness"] if m.startswith(NEVER_LOADED)}
        modules = [m for m in loaded["after"] if m not in harness]
        stray = [m for m in modules if m.startswith(NEVER_LOADED)]
        assert not stray, stray
        assert len(modules) <= MAX_MODULES_TP2, modules
        assert not set(NOT_RUN_AT_TP2) & set(modules), modules
        assert "gramcoord.integrations.vllm.tp_digest" in modules
