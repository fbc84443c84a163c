"""Jump-forward: model steps saved, and outputs kept, per whitespace mode.

``gramcoord bench jump_forward`` decodes dev instances greedily, one request
at a time (``GreedyDecoder``, K = 0), once without jump-forward and once with
it in the default mode (``GrammarConfig().jump_forward_mode``, ``exact``),
for ``any_whitespace`` false and true (true is the default), with
``SyntheticModel`` following each schema's valid instance. Its choice
depends only on the text so far, so exact mode must keep every output
(``gramcoord.rank_worker.masks.jump_forward``). What jump-forward does to a
token-conditioned model's outputs is measured by
``tests/rank_worker/masks/test_jump_identity.py`` (docs/jump-forward.md).

Rows ``jump_forward_steps_synthetic_ws{0,1}`` against ``no_jump_forward``:
the "ms" columns hold *model steps* summed over the instances, so the ratio
is steps without / steps with (1.333 = 25% fewer). The note gives the share
of outputs whose text is identical to the run without jump-forward (over
all runs, and over those that stopped before ``max_tokens`` without it) and
how many runs ended on ``max_tokens``. Target: >= 25% fewer steps with
``any_whitespace: false``; the other row reports only.

Usage: ``gramcoord bench jump_forward [--out DIR] [-- --schemas N]``.
With the defaults it takes about half a minute on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import msgspec
import torch
import xgrammar as xgr

from gramcoord.benchmarks._contract import BenchRecord, add_data_arg, dev_labelled
from gramcoord.engine.decoder import GreedyDecoder
from gramcoord.engine.models import LogitsSource, ModelRequest, SyntheticModel
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer, load_tokenizer
from gramcoord.rank_worker.masks.grammar_state import GrammarState
from gramcoord.rank_worker.masks.jump_forward import JumpForward


class Tally(msgspec.Struct, kw_only=True):
    """One whitespace mode: every instance decoded both ways."""

    num_runs: int = 0
    steps_off: int = 0
    steps_on: int = 0
    # Outputs whose text (and token ids) equal the run without jump-forward.
    same_text: int = 0
    same_ids: int = 0
    # Runs that stopped (stop token or grammar end) without jump-forward,
    # and how many of those kept their text.
    stopped_off: int = 0
    same_text_stopped: int = 0
    length_off: int = 0
    length_on: int = 0
    num_jumps: int = 0
    seconds: float = 0.0


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gramcoord bench jump_forward")
    add_data_arg(p, max_label_ms=60.0)
    p.add_argument("--schemas", type=int, default=120, help="dev instances")
    p.add_argument("--max-tokens", type=int, default=1024, help="output limit")
    args = p.parse_args(argv)
    return args


def dev_records(args: argparse.Namespace) -> list[tuple[str, dict, object]]:
    """(id, schema, first valid instance) of quickly compiling dev schemas."""
    out = []
    for rec, label in dev_labelled(args.data):
        if label.get("status") != "ok" or label.get("compile_ms", 1e9) > args.max_label_ms:
            continue
        valid = [inst["data"] for inst in rec["instances"] if inst["valid"]]
        if valid:
            out.append((rec["id"], rec["schema"], valid[0]))
    return out


def usable_instances(
    tokenizer: Tokenizer, records, any_whitespace: bool, limit: int
) -> list[tuple]:
    """(id, compiled, instance text) for instances xgrammar accepts."""
    compiler = xgr.GrammarCompiler(tokenizer.info, max_threads=1)
    out = []
    for sid, schema, data in records:
        if len(out) >= limit:
            break
        # xgrammar's separators: ", " and ": " without any_whitespace.
        text = json.dumps(data, separators=(",", ":") if any_whitespace else None)
        try:
            compiled = compiler.compile_json_schema(schema, any_whitespace=any_whitespace)
        except Exception:
            continue
        matcher = xgr.GrammarMatcher(compiled)
        if matcher.accept_string(text) and matcher.is_completed():
            out.append((sid, compiled, text))
    return out


def measure(
    tokenizer: Tokenizer,
    model: LogitsSource,
    instances: list[tuple],
    *,
    max_tokens: int,
) -> Tally:
    """Decode every instance without and with default jump-forward."""
    config = GrammarConfig(jump_forward=True)
    jump = JumpForward.from_config(config, tokenizer)
    plain = GreedyDecoder(tokenizer, max_tokens=max_tokens)
    jumped = GreedyDecoder(tokenizer, max_tokens=max_tokens, jump_forward=jump)
    tally = Tally()
    t0 = time.perf_counter()
    # One intra-op thread: one row's logits are too small to split, and two
    # threads on a busy 2-core machine made each step several times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = []
        for sid, compiled, text in instances:
            request = ModelRequest(sid, reference=text)
            runs.append(
                (
                    plain.decode(GrammarState(compiled), model, request),
                    jumped.decode(GrammarState(compiled), model, request),
                )
            )
    finally:
        torch.set_num_threads(threads)
    for a, b in runs:
        tally.num_runs += 1
        tally.steps_off += a.num_steps
        tally.steps_on += b.num_steps
        tally.same_text += a.text == b.text
        tally.same_ids += a.token_ids == b.token_ids
        stopped = a.finish_reason != "length"
        tally.stopped_off += stopped
        tally.same_text_stopped += stopped and a.text == b.text
        tally.length_off += not stopped
        tally.length_on += b.finish_reason == "length"
    tally.num_jumps = jump.stats.num_jumps
    tally.seconds = round(time.perf_counter() - t0, 1)
    return tally


def _record(any_whitespace: bool, max_tokens: int, t: Tally) -> BenchRecord:
    saved = 1 - t.steps_on / t.steps_off
    note = (
        f"model steps, not ms: {t.steps_on} with vs {t.steps_off} without ({saved:.1%} fewer); "
        f"{t.num_runs} dev instances, any_whitespace={str(any_whitespace).lower()}, "
        f"mode {GrammarConfig().jump_forward_mode}; same text {t.same_text}/{t.num_runs} "
        f"({t.same_text / t.num_runs:.0%}), {t.same_text_stopped}/{t.stopped_off} among runs that "
        f"stopped without it; same ids {t.same_ids}/{t.num_runs}; ran to max_tokens={max_tokens}: "
        f"{t.length_off} without, {t.length_on} with; {t.num_jumps} jumps; {t.seconds:.0f} s"
    )
    return BenchRecord.compare(
        f"jump_forward_steps_synthetic_ws{int(any_whitespace)}",
        "no_jump_forward",
        float(t.steps_on),
        float(t.steps_off),
        target=None if any_whitespace else round(1 / 0.75, 3),
        note=note,
    )


def run(args: list[str]) -> list[BenchRecord]:
    a = _args(args)
    tokenizer = load_tokenizer()
    records_in = dev_records(a)
    t0 = time.perf_counter()
    usable = {ws: usable_instances(tokenizer, records_in, ws, a.schemas) for ws in (False, True)}
    print(
        f"bench jump_forward: {len(usable[False])} + {len(usable[True])} usable dev instances "
        f"compiled in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )
    model = SyntheticModel(tokenizer)
    records = []
    for ws in (False, True):
        tally = measure(tokenizer, model, usable[ws], max_tokens=a.max_tokens)
        print(f"bench jump_forward: ws{int(ws)} took {tally.seconds} s", file=sys.stderr)
        records.append(_record(ws, a.max_tokens, tally))
    return records
