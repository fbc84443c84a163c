"""Which role objects a rank holds, and how they are wired together.

``build_roles`` is the one place that turns a rank's coordinates in the
``ParallelLayout`` into its roles (docs/design.md, Topology):

==================================  ===========================================
rank                                roles
==================================  ===========================================
a stage leader                      ``leader``; on the last stage ``masks`` too
                                    (and, with tp > 1, the bitmask channel)
a last-stage TP worker              ``reader`` (it joins the leader's channel)
a TP worker with its own scheduler  ``follower``; on the last stage ``masks``
(``parallel.tp_followers``)         (``fill``: its own rows; ``read``: the
                                    leader's, through the channel)
any other TP worker                 none: it only computes
==================================  ===========================================

The collaborators (the grammar manager, the builder, the channel) are
created here and reach the session only inside the roles.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec

from gramcoord.coordinator.byte_link import ByteLink
from gramcoord.coordinator.layout import ParallelLayout
from gramcoord.coordinator.runtime import Runtime
from gramcoord.rank_worker.faults import RankFaults
from gramcoord.rank_worker.grammars.compile_service import XGrammarBackend
from gramcoord.rank_worker.grammars.manager import GrammarManager
from gramcoord.rank_worker.grammars.tokenizer import Tokenizer
from gramcoord.rank_worker.masks.bitmask import BitmaskBuilder
from gramcoord.rank_worker.masks.gate import Gate
from gramcoord.rank_worker.masks.jump_forward import JumpForward
from gramcoord.rank_worker.session.applier import MaskApplier
from gramcoord.rank_worker.session.followers import (
    FollowerBook,
    NoteSender,
    TpFollower,
)
from gramcoord.rank_worker.session.leader import StageLeader, stage_wait_s
from gramcoord.rank_worker.session.reader import FollowerRows, MaskReader
from gramcoord.rank_worker.session.stage_masks import StageMasks
from gramcoord.rank_worker.session.types import SessionConfig, SessionStats
from gramcoord.sync.channel import BitmaskChannel
from gramcoord.sync.handle import ChannelHandle

logger = logging.getLogger(__name__)

ROLE_NAMES = ("leader", "follower", "masks", "reader")


@dataclass(eq=False)
class RoleSet:
    """One rank's roles (``None`` where the rank does not hold one) and their parts."""

    leader: StageLeader | None = None
    follower: TpFollower | None = None
    masks: StageMasks | FollowerRows | None = None
    reader: MaskReader | None = None
    # The parts the session closes and counts.
    manager: GrammarManager | None = None
    channel: BitmaskChannel | None = None
    rows_reader: MaskReader | None = None
    jump: JumpForward | None = None

    def held(self) -> list[str]:
        """The names of the roles held."""
        return [n for n in ROLE_NAMES if getattr(self, n) is not None]

    def count(self, stats: SessionStats) -> SessionStats:
        """Fill ``stats`` with the parts' counters."""
        stats.manager = self.manager.stats if self.manager is not None else None
        stats.jump_forward = self.jump.stats if self.jump is not None else None
        if self.channel is not None:
            stats.transport_dropped = self.channel.dropped
            stats.transport_corrupted = self.channel.corrupted
        elif self.rows_reader is not None:
            stats.transport_dropped = self.rows_reader.dropped
        return stats

    def closers(self, *, drain: bool, reason: str | None) -> list[tuple[str, object]]:
        """``(part, close)`` in teardown order; ``close`` is None for a part not held."""
        channel = self.channel
        close_channel = None
        if channel is not None:
            close_channel = (lambda: channel.close(reason)) if reason else channel.close
        leader, manager, reader = self.leader, self.manager, self.rows_reader
        return [
            ("reader", reader.close if reader is not None else None),
            ("channel", close_channel),
            ("poison exchange", leader.settle if leader is not None and drain else None),
            ("manager", manager.close if manager is not None else None),
        ]


def build_roles(
    layout: ParallelLayout,
    rank: int,
    runtime: Runtime | None,
    link: ByteLink | None,
    tokenizer: Tokenizer,
    config: SessionConfig,
    *,
    faults: RankFaults,
    stats: SessionStats,
    run_id: str,
    into: RoleSet,
) -> RoleSet:
    """Build ``rank``'s roles into ``into`` (kept filled as far as it got, to close on error)."""
    roles = into
    is_leader = layout.is_stage_leader(rank)
    is_last = layout.is_last_stage(rank)
    followers = config.parallel.tp_followers if layout.tp > 1 else "none"
    is_follower = not is_leader and followers != "none"
    k = config.speculative.num_tokens
    max_seqs = config.scheduler.max_num_seqs
    if is_leader or (is_follower and followers == "fill"):
        compile_fn = None
        if faults.compile_delay is not None or faults.compile_error is not None:
            limit = int(config.grammar.cache_limit_mb * 2**20)
            compile_fn = faults.wrap_compile(XGrammarBackend(tokenizer, cache_limit_bytes=limit))
        roles.manager = GrammarManager(config.grammar, tokenizer, compile_fn=compile_fn)
    applier = None
    if is_last:
        width = (tokenizer.vocab_size + 31) // 32
        applier = MaskApplier(width, max_num_seqs=max_seqs, num_speculative_tokens=k)
    c = layout.coords(rank)
    group = layout.tp_group(c.dp, c.pp)
    if is_last and layout.tp > 1 and followers != "fill":
        assert link is not None
        if is_leader:
            roles.channel = _open_channel(
                link, group, tokenizer.vocab_size, config, faults, run_id, label=f"dp{c.dp}"
            )
            logger.info("[rank %d] bitmask channel: %s", rank, roles.channel.modes)
        else:
            data = link.recv(group[0], operation="transport handle", step=-1)
            handle = msgspec.msgpack.decode(data, type=ChannelHandle)
            roles.rows_reader = MaskReader.connect(
                handle, f"rank{rank}", vocab_size=tokenizer.vocab_size, applier=applier, stats=stats
            )
    masks = None
    if is_last and roles.manager is not None:
        if tokenizer.can_encode:
            roles.jump = JumpForward.from_config(config.grammar, tokenizer)
        elif config.grammar.jump_forward:
            logger.warning(
                "[rank %d] jump-forward is off: vocabulary %r came without an encoder",
                rank,
                tokenizer.name,
            )
        builder = BitmaskBuilder(
            tokenizer.vocab_size, max_num_seqs=max_seqs, num_speculative_tokens=k
        )
        masks = roles.masks = StageMasks(
            builder,
            applier,
            roles.manager.matcher,
            vocab_size=tokenizer.vocab_size,
            gate=Gate.from_config(config.grammar),
            stats=stats,
            channel=roles.channel,
            jump=roles.jump,
            rank=rank,
        )
    hooks = {
        "on_admitted": masks.start if masks is not None else None,
        "on_end": masks.forget if masks is not None else None,
    }
    if is_leader:
        notes = NoteSender(link, group[1:]) if followers != "none" else None
        roles.leader = StageLeader.build(
            roles.manager, layout, runtime, config.distributed, notes=notes, **hooks
        )
    elif is_follower:
        book = FollowerBook() if followers == "read" else None
        if roles.manager is not None:
            roles.manager.follow(stage_wait_s(config.grammar, config.distributed, rank=rank))
        roles.follower = TpFollower(
            link, group[0], rank=rank, book=book, manager=roles.manager, **hooks
        )
        if book is not None and roles.rows_reader is not None:
            roles.masks = FollowerRows(
                roles.rows_reader, applier, stats, book.running, tokenizer.stop_ids, rank=rank
            )
    elif roles.rows_reader is not None:
        roles.reader = roles.rows_reader
    wait_s = config.grammar.store.ready_wait_s
    if roles.manager is not None and wait_s > 0 and not roles.manager.wait_warm(wait_s):
        logger.warning("[rank %d] the spec store's warm start runs on past %gs", rank, wait_s)
    return roles


def _open_channel(
    link: ByteLink,
    group: tuple[int, ...],
    vocab_size: int,
    config: SessionConfig,
    faults: RankFaults,
    run_id: str,
    *,
    label: str,
) -> BitmaskChannel:
    """The TP leader's bitmask channel, its handle sent to every worker, and accepted."""
    channel = BitmaskChannel(
        readers=[f"rank{r}" for r in group[1:]],
        vocab_size=vocab_size,
        max_rows=config.scheduler.max_num_seqs * (1 + config.speculative.num_tokens),
        config=config.transport,
        run_id=run_id,
        label=label,
        corrupt_every=faults.corrupt_every,
    )
    try:
        data = msgspec.msgpack.encode(channel.handle)
        for r in group[1:]:
            link.send(r, data, operation="transport handle", step=-1)
        channel.accept()
    except BaseException:
        channel.close()
        raise
    return channel
