"""Runtime failures of the bitmask transport.

Every error the transport raises at run time derives from
:class:`TransportError`, so a caller can stop a rank on any of them with one
``except``. Errors that concern particular peers carry their names in
``peers``; the message names them too, so a log line is enough to find the
rank at fault.

Bad arguments from the caller (a wrong shape, a step that goes backwards)
are ``ValueError``; those are programming errors, not transport failures.

Every module of ``sync`` raises these; a rank's main program
(``launch.rank_main``) catches :class:`TransportError` to stop the rank with
the message.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "ChannelClosed",
    "HandshakeError",
    "PeerGone",
    "ProtocolError",
    "TransportError",
    "TransportTimeout",
    "WriterLost",
]


class TransportError(RuntimeError):
    """Base class of every runtime failure in ``sync``.

    Parameters
    ----------
    message
        What went wrong, naming the peers involved.
    peers
        Names of the readers (or ``"writer"``) the failure is about.
    """

    def __init__(self, message: str, *, peers: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.peers: tuple[str, ...] = tuple(peers)


class TransportTimeout(TransportError, TimeoutError):
    """A deadline passed: a slot was not released, a step or a hello never came.

    ``peers`` names the readers that were waited for (for a reader-side
    timeout, ``("writer",)``).
    """


class HandshakeError(TransportError):
    """Writer and reader cannot work together.

    Raised for a protocol-version or vocabulary-size mismatch, an unknown
    reader name, or ``transport: shm`` with a reader on another host.
    """


class PeerGone(TransportError):
    """A reader died or said goodbye while the writer still needed it."""


class WriterLost(TransportError):
    """The writer died or its connection closed while a reader waited."""


class ChannelClosed(WriterLost):
    """The writer closed the channel on purpose (it sent ``Shutdown``).

    Readers usually end their loop on this one; the message carries the
    writer's reason.
    """


class ProtocolError(TransportError):
    """A well-formed message that breaks the protocol, e.g. a step out of order."""


def quote_names(names: Iterable[str]) -> str:
    """``'a', 'b'`` for messages; sorted so that messages are stable."""
    return ", ".join(repr(n) for n in sorted(names))
