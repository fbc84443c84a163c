"""Moving bitmasks from a stage leader to its tensor-parallel workers.

The writer (stage leader) owns a :class:`BitmaskChannel`: a shared-memory
:class:`BitmaskRing` of slots plus a zmq control plane. Each TP worker joins
with a :class:`BitmaskReceiver` built from the channel's
:class:`ChannelHandle`. Workers on the leader's host read slots in place;
workers elsewhere get the same bytes as raw zmq frames. Nothing is pickled.

A rank's session (``rank_worker.session``) is the caller: its stage leader
owns the channel and each TP worker a receiver.
"""

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
