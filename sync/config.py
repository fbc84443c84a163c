"""Configuration owned by the bitmask transport.

:class:`TransportConfig` is the ``transport:`` section of a run's config
(``launch.config``) and of a rank's session options
(``rank_worker.session.types``). :class:`~gramcoord.sync.channel.BitmaskChannel`
reads it; what readers need of it travels in the
:class:`~gramcoord.sync.handle.ChannelHandle`.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal

import msgspec
from msgspec import Meta


class TransportConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # "auto" picks shm for readers on the writer's host and tcp otherwise.
    kind: Literal["auto", "shm", "tcp"] = "auto"
    # Ring slots; a slot is reused only after every reader released it.
    num_slots: Annotated[int, Meta(ge=1, le=64)] = 4
    # Seconds a writer waits for a free slot (or a reader for a step).
    timeout_s: Annotated[float, Meta(gt=0)] = 10.0
    # Seconds the writer waits for every reader's hello (and a reader for the
    # writer's answer); kept apart from timeout_s because start-up is slow.
    handshake_timeout_s: Annotated[float, Meta(gt=0)] = 60.0
    # Microseconds a reader on the writer's host polls the ring for its step
    # before sleeping on the control socket: a busy core buys a wake-up in
    # microseconds instead of a scheduler round trip. 0 disables.
    spin_us: Annotated[int, Meta(ge=0, le=1_000_000)] = 1000
    # Address the tcp endpoints bind (readers on other hosts dial it); loopback
    # unless set. "auto": the address this host's name resolves to, loopback
    # when that is one. Wildcards (0.0.0.0, ::) are refused.
    interface: str = "127.0.0.1"

    def __post_init__(self) -> None:
        bare = self.interface.strip().strip("[]")
        try:
            wildcard = bare in ("", "*") or ipaddress.ip_address(bare).is_unspecified
        except ValueError:
            wildcard = False  # "auto" or an interface name
        if wildcard:
            raise ValueError(
                f"transport.interface {self.interface!r} would listen on every interface; "
                "name one address, or 'auto' for the one this host's name resolves to"
            )
