"""Configuration owned by the cross-rank coordinator."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

PosInt = Annotated[int, Meta(ge=1)]
PositiveFloat = Annotated[float, Meta(gt=0)]


class ParallelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Data-parallel replicas.
    dp: PosInt = 1
    # Pipeline stages.
    pp: PosInt = 1
    # Tensor-parallel ranks per stage.
    tp: PosInt = 1
    # "partitioned": each DP replica has its own request stream.
    # "replicated": every DP replica sees the same stream (SPMD / RL).
    requests: Literal["partitioned", "replicated"] = "partitioned"
    # How later pipeline stages learn stage 0's decision.
    pp_sync: Literal["chain", "collective"] = "chain"
    # TP workers with a scheduler of their own (SGLang; vLLM's external
    # launcher): "none" (gramcoord's loop: workers only apply the leader's
    # rows), or they follow their leader's decision each step and either
    # "read" the leader's rows from shared memory or "fill" their own from
    # their own compiles.
    tp_followers: Literal["none", "read", "fill"] = "none"

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp


class DistributedConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Backend of the data plane. Control groups are always gloo on CPU.
    backend: Literal["gloo", "nccl"] = "gloo"
    # Rendezvous deadline at start-up, in seconds: also how long the ranks
    # wait for each other before creating the control groups, and the
    # start-up exchanges.
    init_timeout_s: PositiveFloat = 60.0
    # Deadline of every steady-state collective or point-to-point call.
    step_timeout_s: PositiveFloat = 30.0
    # Rendezvous host; loopback unless the config names an interface.
    master_addr: str = "127.0.0.1"
    # 0 picks a free port at launch.
    master_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    # Number of nodes (torchrun / ray).
    nnodes: PosInt = 1
    # Deadline of a whole run started by `gramcoord run`: past it the
    # launcher kills every rank (exit status 1).
    run_timeout_s: PositiveFloat = 3600.0
    # Restarts of the whole group after a rank fails (launcher: torchrun,
    # through torch's elastic agent). Each restart resumes from the output
    # directory's journal: requests finished before the failure are kept,
    # the rest run again. Injected faults act in the first attempt only.
    max_restarts: Annotated[int, Meta(ge=0, le=100)] = 0
    # Ray cluster for `launcher: ray`: "local" starts a private one-node
    # instance; "auto" or "HOST:PORT" joins a running cluster.
    ray_address: str = "local"
    # Placement group strategy for `launcher: ray`: "PACK" (one node when it
    # fits), "SPREAD" or "STRICT_SPREAD" (one rank per node).
    ray_strategy: Literal["PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    # Readiness collective: "all_gather" of one report per rank, or one
    # fixed-size "all_reduce" (BAND) whose size does not grow with the group
    # (reason codes limited to 1..63).
    agreement_op: Literal["all_gather", "all_reduce"] = "all_gather"
    # Group size from which agreement_op all_gather is replaced by all_reduce.
    # `gramcoord bench scale` (now part of `bench agreement`; gloo, loopback,
    # 2 cores) found no crossover up to 64 ranks: the one-round exchange
    # stayed 1.4-3.8x faster than the ring all_reduce at 64 and 512 pending,
    # so the switch sits past the measured range. Re-measure on real hosts
    # before lowering it.
    agreement_reduce_from: PosInt = 128
    # "flat": every member of an agreement group in one collective. "host":
    # two levels, for groups that span hosts (grouped by hostname): members
    # send their report to their host's leader, the leaders run the
    # collective, each leader broadcasts the result inside its host. Same
    # decisions, 3 rounds instead of 1, but hosts x (hosts - 1) messages
    # across hosts instead of members x (members - 1). On 2 and 4 simulated
    # hosts (2 shared cores) it beat flat at 16 ranks (1.2-2.4x) and tied or
    # lost at 4-8 (docs/scaling.md); the win is mostly fewer messages on
    # oversubscribed cores, so flat stays the default until real hosts agree.
    agreement_levels: Literal["flat", "host"] = "flat"
    # Where DP leaders share newly failed keys: "step" inside every step (so
    # the stage-0 leaders of all replicas step together), or "host": only
    # when the host calls the session's exchange_poison() at one of its own
    # sync points, so replicas with partitioned streams step at their own
    # rates.
    poison_exchange: Literal["step", "host"] = "step"
    # With poison_exchange "step": steps between posting a replica's poison
    # exchange (and end-of-run vote) and settling it. A failure reaches every
    # replica this many steps later, and a replica waits for the others only
    # when it runs this far ahead; 0 settles each exchange in its own step.
    # `gramcoord bench step` measures the step (docs/performance.md).
    poison_lag_steps: Annotated[int, Meta(ge=0, le=64)] = 2
    # gramcoord's step loop: steps per TP determinism check. Every TP rank of
    # the last stage compares the tokens it sampled and the digests of the
    # mask rows it applied with its peers: one posted all_gather per this
    # many steps, settled with the next one, so a difference is reported
    # within twice this many steps, naming the first step and row that
    # differed. 1 checks every step (one collective per step).
    tp_check_steps: Annotated[int, Meta(ge=1, le=1024)] = 8
    # Inside vLLM (the per-step agreement of rank_worker.session.futures): the
    # most engine steps between two agreements while a request waits. After
    # every 4 agreements in a row that decided nothing the gap doubles, up to
    # this; a new request or a decision sets it back to 1. A decision then
    # comes at most about a quarter later than the time already waited, and
    # the steps in between decode without a collective. 1 agrees every step.
    # (SGLang's adapter agrees in a loop that blocks its scheduler: it always
    # agrees every round.)
    agree_max_gap_steps: Annotated[int, Meta(ge=1, le=64)] = 8
    # Idle steps (nothing pending) between clock agreements, so poison TTLs
    # still expire at an agreed instant when no request is waiting. With
    # compile_mode sync (the external launcher) these are the only
    # collectives while requests run, so a lost peer is noticed within this
    # many steps plus step_timeout_s: keep it small.
    clock_sync_steps: PosInt = 8
