"""The writer's roster of readers: the handshake, how each joined, who left or died.

:class:`~gramcoord.sync.channel.BitmaskChannel` hands every message a reader sends to
its :class:`Roster`. The roster answers hellos (``Welcome``, or ``Bye`` with
the reason), records releases of readers that are not on the writer's host
in the ring, and keeps, per reader, whether it said bye, restarted or died,
so that a waiting writer can name the reader at fault instead of timing out.
The reader's half of the handshake is :func:`gramcoord.sync.handle.join`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Literal

from gramcoord.sync.control import ControlServer
from gramcoord.sync.errors import HandshakeError, PeerGone, TransportError, quote_names
from gramcoord.sync.hosts import choose_mode, pid_alive
from gramcoord.sync.messages import PROTOCOL_VERSION, Bye, Hello, ReaderMessage, Release, Welcome
from gramcoord.sync.ring import BitmaskRing

logger = logging.getLogger(__name__)

__all__ = ["Peer", "Roster"]


@dataclasses.dataclass
class Peer:
    """One reader that said hello."""

    # The reader's name.
    name: str
    # How it gets its rows.
    mode: Literal["shm", "tcp"]
    # Its pid, from its hello.
    pid: int
    # Whether it runs on the writer's host (so its pid can be checked).
    local: bool
    # Why it is gone (bye, restart, death); None while it is in.
    gone: str | None = None


class Roster:
    """The readers a writer expects and what became of them.

    Parameters
    ----------
    names
        The readers the writer waits for.
    kind
        ``TransportConfig.kind``.
    hostname
        The writer's host name.
    vocab_size
        The writer's vocabulary size; a reader's hello must match it.
    control
        The writer's control socket, for answers.
    ring
        The writer's ring, for releases sent as messages.
    """

    def __init__(
        self,
        names: Sequence[str],
        *,
        kind: str,
        hostname: str,
        vocab_size: int,
        control: ControlServer,
        ring: BitmaskRing,
    ) -> None:
        self.names = tuple(names)
        self.peers: dict[str, Peer] = {}
        self._kind = kind
        self._host = hostname
        self._vocab_size = vocab_size
        self._control = control
        self._ring = ring

    @property
    def missing(self) -> list[str]:
        """Readers that have not said hello yet, in roster order."""
        if len(self.peers) == len(self.names):
            return []  # the per-step case, without building a list
        return [n for n in self.names if n not in self.peers]

    @property
    def modes(self) -> dict[str, str]:
        """``{reader: "shm" | "tcp"}`` for every reader that joined."""
        return {name: peer.mode for name, peer in self.peers.items()}

    @property
    def has_shm_readers(self) -> bool:
        """Whether any reader reads ring slots in place."""
        return any(peer.mode == "shm" for peer in self.peers.values())

    def handle(self, sender: str, message: ReaderMessage) -> None:
        """Act on one message from ``sender``.

        Raises
        ------
        HandshakeError
            If a new reader's hello cannot be accepted (after telling it why).
        """
        if sender not in self.names:
            self._control.reject(f"message from unknown reader {sender!r}")
            if isinstance(message, Hello):
                self._bye(sender, f"unknown reader; this channel serves {quote_names(self.names)}")
            return
        match message:
            case Release(step=step):
                self._ring.set_released(sender, step)
            case Hello():
                self._hello(sender, message)
            case Bye(reason=reason):
                logger.info("reader %s said bye: %s", sender, reason)
                if sender in self.peers:
                    self.peers[sender].gone = f"said bye ({reason})"

    def raise_if_gone(self, names: Iterable[str]) -> None:
        """Raise PeerGone for the first of ``names`` that left.

        Raises
        ------
        PeerGone
            Naming the reader and why it is gone.
        """
        for name in names:
            peer = self.peers.get(name)
            if peer is not None and peer.gone is not None:
                raise PeerGone(f"reader {name!r} left: {peer.gone}", peers=[name])

    def raise_if_dead(self, names: Iterable[str]) -> None:
        """Like :meth:`raise_if_gone`, and also check the pids of local readers.

        Raises
        ------
        PeerGone
            Naming the reader that left or whose process is gone.
        """
        names = tuple(names)
        self.raise_if_gone(names)
        for name in names:
            peer = self.peers.get(name)
            if peer is not None and peer.local and not pid_alive(peer.pid):
                raise PeerGone(f"reader {name!r} (pid {peer.pid}) died", peers=[name])

    def _hello(self, sender: str, hello: Hello) -> None:
        known = self.peers.get(sender)
        if known is not None:
            # Never answered with a Bye: it would reach the reader that joined.
            if known.pid != hello.pid:
                known.gone = f"restarted (pid {known.pid} -> {hello.pid})"
            elif (hello.version, hello.vocab_size) != (PROTOCOL_VERSION, self._vocab_size):
                self._control.reject(f"second hello from {sender!r} does not match its first")
            else:
                self._welcome(sender, known.mode)
            return
        problem = None
        mode = choose_mode(self._kind, self._host, hello.hostname)
        if hello.version != PROTOCOL_VERSION:
            problem = f"protocol version {hello.version}, writer speaks {PROTOCOL_VERSION}"
        elif hello.vocab_size != self._vocab_size:
            problem = f"vocab_size {hello.vocab_size}, writer's masks are for {self._vocab_size}"
        elif mode is None:
            problem = (
                f"transport 'shm' but the reader is on {hello.hostname!r}, writer on {self._host!r}"
            )
        if problem is not None:
            self._bye(sender, problem)
            raise HandshakeError(f"reader {sender!r} rejected: {problem}", peers=[sender])
        assert mode is not None
        self.peers[sender] = Peer(sender, mode, hello.pid, hello.hostname == self._host)
        self._welcome(sender, mode)
        logger.debug(
            "reader %s (pid %s on %s) joined via %s", sender, hello.pid, hello.hostname, mode
        )

    def _welcome(self, reader: str, mode: Literal["shm", "tcp"]) -> None:
        index = self.names.index(reader)
        welcome = Welcome(PROTOCOL_VERSION, self._vocab_size, index, mode)
        self._control.send(reader, self._control.encode(welcome))

    def _bye(self, reader: str, reason: str) -> None:
        bye = Bye(PROTOCOL_VERSION, self._vocab_size, reader, reason)
        try:
            self._control.send(reader, self._control.encode(bye))
        except TransportError as exc:
            logger.debug("could not tell %s bye: %s", reader, exc)
