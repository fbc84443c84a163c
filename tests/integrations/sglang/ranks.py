"""Rank bodies of the 2-rank tests: SGLang's real ``GrammarManager`` over our backend.

Each spawned rank publishes SGLang's context (``host``), makes its gloo
world's group SGLang's grammar sync group, and builds the real
``GrammarManager`` from a scheduler holder with the fields its constructor
reads; ``create_grammar_backend`` then builds our backend through the
registry. ``drive`` is SGLang's event-loop shape around the manager: new
requests go through ``process_req_with_grammar``, and each iteration calls
``get_ready_grammar_requests`` under ``has_waiting_grammars()``, exactly
as SGLang's scheduler does. Compile faults are injected here, by the
driver, into our backend class (never into SGLang's code).
"""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests import dev_data
from tests.load import scaled

SCHEMA_IDS = (
    "Github_trivial/o32735",
    "Github_easy/o69751",
    "Github_medium/o79651",
    "MCPspec/CancelledNotification",
)
# Log rows: (iteration, request id, what the request got).
Log = list[tuple[int, str, str]]


def schemas() -> list[str]:
    return [json.dumps(dev_data.schema(w)) for w in SCHEMA_IDS]


@dataclass
class Req:
    """The fields of SGLang's ``Req`` that the grammar manager reads and writes."""

    rid: str
    json_schema: str
    grammar: Any = None
    grammar_key: Any = None
    grammar_wait_ct: int = 0
    require_reasoning: bool = False
    origin_input_ids: list[int] = field(default_factory=lambda: [1])
    finished_reason: str | None = None

    def __post_init__(self) -> None:
        self.sampling_params = SimpleNamespace(
            json_schema=self.json_schema,
            regex=None,
            ebnf=None,
            structural_tag=None,
            ebnf_full_assistant=False,
            custom_params=None,
        )

    def finished(self) -> bool:
        return self.finished_reason is not None

    def set_finish_with_abort(self, error_msg: str) -> None:
        self.finished_reason = error_msg


def _what(req: Req) -> str:
    return f"aborted: {req.finished_reason}" if req.finished() else type(req.grammar).__name__


def manager(group: Any) -> Any:
    """SGLang's real ``GrammarManager`` with ``group`` as its sync group."""
    import torch.distributed as dist
    from sglang.srt.constrained.grammar_manager import GrammarManager

    from tests.integrations.sglang.host import host, set_sync_group

    h = host(tp_size=dist.get_world_size())
    holder = set_sync_group(group)
    scheduler = SimpleNamespace(
        server_args=h.server_args,
        tokenizer=h.tokenizer,
        model_config=SimpleNamespace(
            vocab_size=h.vocab_size, hf_eos_token_id=h.eos_token_ids, think_end_ids=None
        ),
        dp_tp_cpu_group=holder.cpu_group,
        dp_tp_group=holder,
        pp_group=None,
    )
    return GrammarManager(scheduler)


def drive(m: Any, arrivals: dict[int, list[Req]], *, max_iters: int = 3000) -> Log:
    """SGLang's loop shape; stops once every request left the grammar queue."""
    log: Log = []
    last = max(arrivals, default=0)
    for it in range(max_iters):
        for req in arrivals.get(it, []):
            if not m.process_req_with_grammar(req):
                log.append((it, req.rid, _what(req)))
        if m.has_waiting_grammars():
            try:
                ready = m.get_ready_grammar_requests()
            except Exception as exc:  # SGLang's own collective failed
                log.append((it, "*", f"error: {type(exc).__name__}: {exc}"))
                return log
            log += [(it, req.rid, _what(req)) for req in ready]
        elif it > last:
            return log
        time.sleep(0.005)  # the forward pass
    log.append((max_iters, "*", "error: iterations ran out"))
    return log


def inject(
    rank: int,
    *,
    delay_rank: int = -1,
    delay_s: float = 0.0,
    fail_rank: int = -1,
    fail_marker: str = "",
) -> None:
    """Slow down or fail this rank's compiles (in our backend class)."""
    from gramcoord.integrations.sglang.backend import SglangBackend

    real = SglangBackend._compile

    def compile_(self, spec):
        if rank == delay_rank:
            time.sleep(delay_s)
        if rank == fail_rank and fail_marker in spec.text:
            raise RuntimeError(f"injected compile failure on rank {rank}")
        return real(self, spec)

    SglangBackend._compile = compile_


def scenarios(rank: int, world: int) -> dict[str, Any]:
    """Skew, a failing compile, a warm start, then mismatched queues (last: it breaks the group)."""
    import torch.distributed as dist

    s = schemas()
    out: dict[str, Any] = {}
    world_group = dist.group.WORLD

    inject(rank, delay_rank=1, delay_s=0.4)
    m = manager(world_group)
    reqs = {0: [Req(f"a{i}", s[i]) for i in range(3)], 3: [Req("a3", s[0]), Req("a4", s[3])]}
    out["skew"] = drive(m, reqs)
    out["skew_collectives"] = m.grammar_backend.grammars.num_collectives
    m.grammar_backend.close()

    inject(rank, fail_rank=1, fail_marker="CancelledNotification")
    m = manager(world_group)
    reqs = {0: [Req("b0", s[3]), Req("b1", s[1])], 40: [Req("b2", s[3])]}
    out["fail"] = drive(m, reqs)
    m.grammar_backend.close()

    # A spec store's warm start (an operator's list, the same on both ranks;
    # rank 1 compiles slower): each rank holds its start until its own warm
    # compile is done, then both admit the listed schema from it, and one
    # that is not listed from a compile of its own, on the same iterations.
    from gramcoord.integrations.sglang.backend import OPTIONS_ENV

    listed = Path(os.environ["GRAMCOORD_SGLANG_TMP"]) / f"tools-{rank}.jsonl"
    listed.write_text(json.dumps({"json": s[2]}) + "\n")
    os.environ[OPTIONS_ENV] = json.dumps({"store": {"preload": [str(listed)], "ready_wait_s": 60}})
    try:
        m = manager(world_group)
    finally:
        del os.environ[OPTIONS_ENV]
    out["warm"] = drive(m, {0: [Req("w0", s[2]), Req("w1", s[0])]})
    out["warm_joined"] = m.grammar_backend.grammars.leader._manager.stats.warm
    m.grammar_backend.close()

    # A short timeout: SGLang's own all_gather waits on it once the queues
    # differ. Five seconds on a quiet machine, as long as that takes now: the
    # exchanges before the divergence must not time out on a busy one (a
    # loaded run saw gloo's 5 s send timeout before the first agreement).
    short = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=scaled(5)))
    m = manager(short)
    mine = [Req("c0", s[0]), Req("c1", s[1])] if rank == 0 else [Req("c1", s[1])]
    t0 = time.monotonic()
    out["mismatch"] = drive(m, {0: mine})
    out["mismatch_s"] = time.monotonic() - t0
    return out
