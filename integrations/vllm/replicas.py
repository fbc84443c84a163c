"""Poison shared across vLLM's data-parallel replicas (``external_launcher``).

With ``data_parallel_size > 1`` under ``external_launcher`` (torchrun starts
one process per replica), every replica runs its own scheduler and compiles
on its own. A schema that costs ``compile_timeout_s`` and then times out on
one replica would cost as much again on every replica a load balancer sends
it to. vLLM already has a gloo group between the replicas (its DP group's
``cpu_group``) and already calls one collective on it every engine step, on
every replica alike: ``LLMEngine.has_unfinished_requests_dp``, its
all_reduce of "does any replica have work left?". Dummy batches keep idle
replicas in that loop, so every replica makes the call the same number of
times.

``sync_replicas`` runs at that call: ``rank_worker.session.replicas.ReplicaPoison``
posts the keys this replica poisoned since the last call (code, agreed
clock, message) without waiting, and settles the exchange posted
``distributed.poison_lag_steps`` calls ago into this replica's grammar
manager. A replica that meets the key again fails it at once, with the code
and the message of the replica that learnt it, and compiles nothing.

One ``ReplicaPoison`` per process: the backend attaches its grammar manager
when vLLM builds it (at the first structured request), which may be after
the first sync. Replicas of vLLM's multiprocess DP mode (``vllm serve
--data-parallel-size``) run dense models as independent engines with no
per-step collective between them; they share nothing (``docs/vllm.md``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from gramcoord.integrations.vllm.options import parse

if TYPE_CHECKING:
    # Loaded only where replicas share poison (``shares_poison``).
    from gramcoord.rank_worker.session.replicas import ReplicaPoison

__all__ = ["replica_poison", "reset", "shares_poison", "sync_replicas"]

logger = logging.getLogger(__name__)

_NAME = "gramcoord"
_poison: ReplicaPoison | None = None


def shares_poison(vllm_config: Any) -> bool:
    """Do this engine's replicas share poison (gramcoord, DP > 1, external launcher)?"""
    parallel = vllm_config.parallel_config
    so = vllm_config.structured_outputs_config
    return (
        so is not None
        and so.backend == _NAME
        and parallel.data_parallel_size > 1
        and parallel.distributed_executor_backend == "external_launcher"
    )


def replica_poison(vllm_config: Any) -> ReplicaPoison | None:
    """This process's ``ReplicaPoison`` over vLLM's DP group (made at the first call)."""
    global _poison
    if _poison is None and shares_poison(vllm_config):
        from vllm.distributed.parallel_state import get_dp_group

        from gramcoord.rank_worker.session.replicas import ReplicaPoison

        distributed = parse((vllm_config.additional_config or {}).get("gramcoord")).distributed
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            logger.warning(
                "gramcoord: poison is shared between DP replicas rank by rank of their TP "
                "groups; DP > 1 with TP > 1 is not tested"
            )
        _poison = ReplicaPoison(get_dp_group().cpu_group, distributed)
        logger.info(
            "gramcoord: poison shared between %d data-parallel replicas (lag %d steps)",
            _poison.size,
            distributed.poison_lag_steps,
        )
    return _poison


def sync_replicas(vllm_config: Any) -> None:
    """vLLM's per-step DP collective is about to run: exchange poison first."""
    poison = replica_poison(vllm_config)
    if poison is not None:
        poison.sync()


def reset() -> None:
    """Forget this process's ``ReplicaPoison`` (tests that build several engines)."""
    global _poison
    _poison = None
