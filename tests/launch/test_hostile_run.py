"""The hostile-input corpus inside a run, next to normal requests.

Two one-process runs (``launcher: inline``) through the CLI in this process:
normal records from ``configs/workload.jsonl`` alone, then the same records
with every line of ``tests/data/hostile/hostile.jsonl.gz`` interleaved. The
run must complete; each hostile record fails with its code or finishes as
recorded; each normal record's output (status, text, token ids, finish
reason, error code) and mask digests equal those of the run without the
hostile ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gramcoord.launch.cli import main
from tests.data.hostile import make_hostile
from tests.launch.e2e_support import (
    CONFIGS,
    EXPECTED_FAILURES,
    SMALL_IDS,
    SMALL_MAX_TOKENS,
    fast,
    leak_guarded,
    read_digests,
    read_outputs,
    sets,
    squash,
    write_workload,
)

INLINE = ("launcher=inline", "parallel.dp=1", "parallel.tp=1")
# Deadlines are not under test here: enum-10k compiles in about a second on a
# quiet machine and may take many on a busy one.
NO_DEADLINE = ("grammar.compile_timeout_s=600",)
# The corpus's codes refuse what xgrammar would not enforce (the default
# admits it with a warning and checks the output).
REFUSE = ("grammar.reject_ignored_features=true",)
# Fields of an output record that must not change when hostile requests run
# beside it (cache and timing facts may).
SAME = ("status", "finish_reason", "text", "token_ids")


leak_guard = pytest.fixture(autouse=True)(leak_guarded)


def _run(capfd, workload: Path, out: Path) -> list[dict]:
    argv = ["run", str(CONFIGS / "local.yaml"), "--workload", str(workload), "--out", str(out)]
    rc = main(argv + sets(*fast(), *INLINE, *NO_DEADLINE, *REFUSE))
    text = squash(capfd.readouterr().out)
    assert rc == 0, text
    return read_outputs(out)


def _mixed(path: Path, normal: Path, hostile: list[make_hostile.CorpusLine]) -> list[str | None]:
    """Normal and hostile lines interleaved; the hostile id of each line (None: normal)."""
    lines = [(line, None) for line in normal.read_text().splitlines() if line.strip()]
    mixed: list[tuple[str, str | None]] = []
    stride = max(1, len(hostile) // len(lines))
    for i, entry in enumerate(hostile):
        if i % stride == 0 and lines:
            mixed.append(lines.pop(0))
        mixed.append((entry.line, entry.id))
    mixed += lines
    path.write_text("".join(line + "\n" for line, _ in mixed), encoding="utf-8")
    return [rid for _, rid in mixed]


@pytest.mark.timeout(300)
def test_hostile_requests_fail_alone(tmp_path, capfd):
    normal = write_workload(tmp_path / "normal.jsonl", SMALL_IDS, max_tokens=SMALL_MAX_TOKENS)
    alone = _run(capfd, normal, tmp_path / "alone")
    hostile = make_hostile.read_corpus()
    by_id = {e.id: e for e in hostile}
    order = _mixed(tmp_path / "mixed.jsonl", normal, hostile)
    mixed = _run(capfd, tmp_path / "mixed.jsonl", tmp_path / "mixed")

    # One output per line, in workload order.
    assert len(mixed) == len(order)
    wrong = []
    for out, rid in zip(mixed, order):
        if rid is None:
            continue
        expect = by_id[rid].expect
        code = (out["error"] or {}).get("code")
        if "code" in expect:
            got = (out["status"], code)
            want = ("failed", expect["code"])
        else:
            got = (out["status"], out["finish_reason"])
            want = ("ok", expect["finish"])
            warning = expect.get("warning")
            if warning and not any(w.startswith(warning) for w in out["warnings"]):
                got += ("no warning",)
        if got != want:
            wrong.append((rid, want, got, (out["error"] or {}).get("message", "")[:200]))
    assert wrong == []

    # The normal records: the same outputs and the same mask rows.
    normal_ids = [o["id"] for o in alone]
    assert normal_ids == list(SMALL_IDS)
    beside = {o["id"]: o for o, rid in zip(mixed, order) if rid is None}
    assert list(beside) == normal_ids
    for o in alone:
        b = beside[o["id"]]
        assert {k: b[k] for k in SAME} == {k: o[k] for k in SAME}, o["id"]
        assert (b["error"] or {}).get("code") == (o["error"] or {}).get("code")
        assert (o["error"] or {}).get("code") == EXPECTED_FAILURES.get(o["id"])
    digests_alone = read_digests(tmp_path / "alone")
    digests_mixed = read_digests(tmp_path / "mixed")
    assert digests_alone and all(digests_mixed[rid] == rows for rid, rows in digests_alone.items())
    summary = json.loads((tmp_path / "mixed" / "summary.json").read_text())
    assert summary["determinism"]["mismatches"] == 0
    assert summary["requests"]["total"] == len(order)
