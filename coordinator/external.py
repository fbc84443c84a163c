"""External-launcher mode: run inside a world that the host program made.

RL and SPMD frameworks start their own ranks (often with their own
``torchrun``) and call ``init_process_group`` themselves. gramcoord then:

- builds its layout from the existing world (``ParallelLayout.from_world``);
- creates its gloo control groups inside that world, never destroying the
  host's default group;
- forces ``compile_mode: sync``: grammars compile inline at admission, so
  every rank knows readiness locally and the readiness collective is not
  needed. It logs a line saying so.
"""

from __future__ import annotations

import logging
from typing import Literal

import msgspec
import torch.distributed as dist

from gramcoord.coordinator.config import DistributedConfig, ParallelConfig
from gramcoord.coordinator.errors import CoordinatorError
from gramcoord.coordinator.layout import ParallelLayout
from gramcoord.coordinator.runtime import Runtime

logger = logging.getLogger(__name__)

FORCED_COMPILE_MODE: Literal["sync"] = "sync"


class ExternalWorld(msgspec.Struct, frozen=True, kw_only=True):
    """What attaching to a host's world gives back."""

    layout: ParallelLayout
    runtime: Runtime
    # The compile mode the rank must use ("sync"); apply it to the grammar
    # config with msgspec.structs.replace.
    compile_mode: Literal["sync"] = FORCED_COMPILE_MODE


def attach_external(parallel: ParallelConfig, distributed: DistributedConfig) -> ExternalWorld:
    """Attach gramcoord to the host's initialized process group.

    Parameters
    ----------
    parallel:
        The ``parallel`` section; ``dp`` is derived from the world size when
        left at 1.
    distributed:
        The ``distributed`` section (step timeout of the control groups).

    Returns
    -------
    ExternalWorld
        The layout, a runtime that does not own the world, and the forced
        compile mode.

    Raises
    ------
    CoordinatorError
        If ``torch.distributed`` is not initialized.
    LayoutError
        If the parallel section does not fit the world.
    """
    if not dist.is_initialized():
        raise CoordinatorError(
            "launcher 'external' needs the host to call torch.distributed.init_process_group "
            "before gramcoord attaches"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = ParallelLayout.from_world(parallel, world)
    runtime = Runtime.attach(layout, distributed=distributed)
    logger.info(
        "[rank %d] external launcher: using the host's process group (world %d, backend %s, "
        "dp=%d pp=%d tp=%d); compile_mode forced to %r, so the readiness collective is skipped",
        rank,
        world,
        dist.get_backend(),
        layout.dp,
        layout.pp,
        layout.tp,
        FORCED_COMPILE_MODE,
    )
    return ExternalWorld(layout=layout, runtime=runtime)
