"""Moving bitmasks from a stage leader to its tensor-parallel workers.

The writer (stage leader) owns a :class:`BitmaskChannel`: a shared-memory
:class:`BitmaskRing` of slots plus a zmq control plane. Each TP worker joins
with a :class:`BitmaskReceiver` built from the channel's
:class:`ChannelHandle`. Workers on the leader's host read slots in place;
workers elsewhere get the same bytes as raw zmq frames. Nothing is pickled.

A rank's session (``rank_worker.session``) is the caller: its stage leader
owns the channel and each TP worker a receiver.

Members import on first use (PEP 562), so that a module needing one of them
(``sync.config`` in a session's config, say) loads only that one.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the module that defines it.
_WHERE = {
    "BitmaskChannel": "channel",
    "TransportConfig": "config",
    "ChannelClosed": "errors",
    "HandshakeError": "errors",
    "PeerGone": "errors",
    "ProtocolError": "errors",
    "TransportError": "errors",
    "TransportTimeout": "errors",
    "WriterLost": "errors",
    "ChannelHandle": "handle",
    "PROTOCOL_VERSION": "messages",
    "BitmaskFrame": "messages",
    "BitmaskReady": "messages",
    "Bye": "messages",
    "Hello": "messages",
    "Release": "messages",
    "Shutdown": "messages",
    "Welcome": "messages",
    "BitmaskReceiver": "receiver",
    "BitmaskRing": "ring",
    "RingHandle": "ring_layout",
}

__all__ = [
    "PROTOCOL_VERSION",
    "BitmaskChannel",
    "BitmaskFrame",
    "BitmaskReady",
    "BitmaskReceiver",
    "BitmaskRing",
    "Bye",
    "ChannelClosed",
    "ChannelHandle",
    "HandshakeError",
    "Hello",
    "PeerGone",
    "ProtocolError",
    "Release",
    "RingHandle",
    "Shutdown",
    "TransportConfig",
    "TransportError",
    "TransportTimeout",
    "Welcome",
    "WriterLost",
]

if TYPE_CHECKING:
    from gramcoord.sync.channel import BitmaskChannel
    from gramcoord.sync.config import TransportConfig
    from gramcoord.sync.errors import (
        ChannelClosed,
        HandshakeError,
        PeerGone,
        ProtocolError,
        TransportError,
        TransportTimeout,
        WriterLost,
    )
    from gramcoord.sync.handle import ChannelHandle
    from gramcoord.sync.messages import (
        PROTOCOL_VERSION,
        BitmaskFrame,
        BitmaskReady,
        Bye,
        Hello,
        Release,
        Shutdown,
        Welcome,
    )
    from gramcoord.sync.receiver import BitmaskReceiver
    from gramcoord.sync.ring import BitmaskRing
    from gramcoord.sync.ring_layout import RingHandle


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
