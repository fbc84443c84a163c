"""A host program that owns its world, run by the external-launcher test.

``python -m torch.distributed.run --nproc_per_node=2 external_main.py OUT``:
the host calls ``init_process_group`` itself; gramcoord attaches, forces
sync compiles, and both ranks run the same replicated stream.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import msgspec
import torch.distributed as dist

from gramcoord.coordinator.config import DistributedConfig, ParallelConfig
from gramcoord.coordinator.external import attach_external
from gramcoord.rank_worker.config import GrammarConfig
from gramcoord.rank_worker.grammars.manager import GrammarManager
from tests.conftest import make_tiny_tokenizer
from tests.coordinator.ranks import coordinator_of


def main(out_dir: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)  # the host's logging
    dist.init_process_group("gloo")
    world = attach_external(
        ParallelConfig(requests="replicated"), DistributedConfig(step_timeout_s=20)
    )
    grammar = msgspec.structs.replace(GrammarConfig(), compile_mode=world.compile_mode)
    manager = GrammarManager(grammar, make_tiny_tokenizer())
    with world.runtime as runtime:
        distributed = DistributedConfig(step_timeout_s=20)
        coordinator = coordinator_of(manager, world.layout, runtime, distributed)
        specs = [{"regex": "[a-z]+"}, {"json": "{not json"}, {"regex": "[0-9]+"}]
        history, outcomes = [], []
        for step in range(1, 6):
            if step <= len(specs):
                o = manager.add(f"r{step}", specs[step - 1], seq=step)
                if o.status == "failed":
                    outcomes.append((o.request_id, o.status, o.code))
            result = coordinator.step(step, manager)
            d = result.decision
            history.append((d.step, d.ready, d.failed))
            outcomes += [(o.request_id, o.status, o.code) for o in result.outcome]
        record = dict(
            history=history,
            outcomes=sorted(outcomes),
            layout=[world.layout.dp, world.layout.pp, world.layout.tp],
            compile_mode=world.compile_mode,
            collectives=coordinator.agreement.collectives,
        )
    rank = dist.get_rank()
    Path(out_dir, f"rank{rank}.json").write_bytes(msgspec.json.encode(record))
    manager.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
