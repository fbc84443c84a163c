"""Control-plane messages of the bitmask transport.

Every message is a frozen ``msgspec`` Struct in a tagged union encoded as a
msgpack array whose first element is the tag, e.g. ``["ready", 7, 1, 64,
["r1", ...], [0, ...]]``. Each direction has its own union and therefore its
own decoder, built once per socket: a reader can never decode a ``Hello``
and the writer never decodes a ``BitmaskReady``. Field constraints
(``Meta``) are checked while decoding, so a frame with a negative step or an
empty reader name is rejected by the decoder itself, before any code looks
at it.

Writer -> reader: :class:`Welcome`, :class:`BitmaskReady` (the rows are in a
ring slot), :class:`BitmaskFrame` (the rows follow as one raw frame),
:class:`Shutdown`, :class:`Bye`.

Reader -> writer: :class:`Hello`, :class:`Release`, :class:`Bye`.

Bitmasks themselves never pass through msgspec: they are ring slots or raw
zmq frames.

The control sockets (:mod:`gramcoord.sync.control`) decode with the decoders
built here; the channel's :class:`~gramcoord.sync.announcement.Announcer`,
the :class:`~gramcoord.sync.roster.Roster`, the reader's handshake
(:mod:`gramcoord.sync.handle`) and :class:`~gramcoord.sync.receiver.BitmaskReceiver`
build and match the messages. Admission (``rank_worker.grammars.manager``)
refuses request ids longer than :data:`MAX_REQUEST_ID_CHARS`.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

__all__ = [
    "PROTOCOL_VERSION",
    "READER_NAME_PATTERN",
    "BitmaskFrame",
    "BitmaskReady",
    "Bye",
    "Hello",
    "ReaderMessage",
    "ReadyDecoder",
    "Release",
    "Shutdown",
    "Welcome",
    "WriterMessage",
    "reader_decoder",
    "valid_reader_name",
    "writer_decoder",
]

# Bumped on any change to the messages or to the ring layout; both ends
# compare it in the handshake.
PROTOCOL_VERSION = 1

# Reader names double as zmq routing ids, which must not start with a zero
# byte; the pattern also keeps them printable in error messages.
READER_NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}\Z"
ReaderName = Annotated[str, Meta(pattern=READER_NAME_PATTERN)]
Step = Annotated[int, Meta(ge=0, le=2**62)]
Count = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Version = Annotated[int, Meta(ge=1, le=2**31 - 1)]
VocabSize = Annotated[int, Meta(ge=1, le=2**31 - 1)]
Text = Annotated[str, Meta(max_length=4096)]
# Longest request id the wire accepts; admission rejects longer ones so a
# single request can never break a whole batch's publish.
MAX_REQUEST_ID_CHARS = 1024
RequestIds = Annotated[
    tuple[Annotated[str, Meta(max_length=MAX_REQUEST_ID_CHARS)], ...], Meta(max_length=1 << 20)
]
DraftCounts = Annotated[tuple[Count, ...], Meta(max_length=1 << 20)]


class _Message(msgspec.Struct, tag=True, array_like=True, frozen=True, forbid_unknown_fields=True):
    # forbid_unknown_fields: extra trailing elements are an error, not ignored;
    # protocol changes go through PROTOCOL_VERSION instead.
    pass


class Hello(_Message, tag="hello"):
    """A reader introduces itself; the writer answers ``Welcome`` or ``Bye``."""

    # PROTOCOL_VERSION of the reader.
    version: Version
    # Vocabulary size the reader will apply masks to.
    vocab_size: VocabSize
    # The reader's name, as listed when the writer created the channel.
    reader: ReaderName
    # socket.gethostname() of the reader: "transport: auto" picks shm when it
    # equals the writer's.
    hostname: Annotated[str, Meta(max_length=255)]
    # Reader pid, so the writer can tell a dead local reader from a slow one.
    pid: Annotated[int, Meta(ge=0)]


class Welcome(_Message, tag="welcome"):
    """The writer accepted a reader."""

    # PROTOCOL_VERSION of the writer.
    version: Version
    # Vocabulary size of the writer's masks.
    vocab_size: VocabSize
    # The reader's row in the ring's release table.
    index: Count
    # How this reader gets its rows: ring slots ("shm") or raw frames ("tcp").
    mode: Literal["shm", "tcp"]


class Bye(_Message, tag="bye"):
    """Either end leaves, or the writer turns a reader away (with a reason)."""

    # PROTOCOL_VERSION of the sender.
    version: Version
    # Vocabulary size of the sender.
    vocab_size: VocabSize
    # The reader concerned.
    reader: ReaderName
    # Why, for the log and for the exception on the other end.
    reason: Text


class Release(_Message, tag="release"):
    """A tcp reader is done with ``step`` (and every earlier step)."""

    # The reader releasing.
    reader: ReaderName
    # The newest step it released.
    step: Step


class BitmaskReady(_Message, tag="ready"):
    """The rows of ``step`` are in ring slot ``slot``."""

    # Engine step the rows belong to; strictly increasing.
    step: Step
    # Ring slot holding the rows.
    slot: Count
    # Number of bitmask rows written.
    rows: Count
    # Requests in scheduling order; each owns 1 + its draft count rows.
    request_ids: RequestIds
    # Draft tokens per request, aligned with request_ids.
    num_drafts: DraftCounts


class BitmaskFrame(_Message, tag="frame"):
    """The rows of ``step`` follow as one raw frame of little-endian int32."""

    # Engine step the rows belong to; strictly increasing.
    step: Step
    # Number of bitmask rows in the raw frame.
    rows: Count
    # int32 words per row; the raw frame holds rows * width * 4 bytes.
    width: Count
    # Requests in scheduling order; each owns 1 + its draft count rows.
    request_ids: RequestIds
    # Draft tokens per request, aligned with request_ids.
    num_drafts: DraftCounts


class Shutdown(_Message, tag="shutdown"):
    """The writer closes the channel; readers stop receiving."""

    # Why, for the reader's ChannelClosed error.
    reason: Text


class _ReadyHead(_Message, tag="ready"):
    # BitmaskReady with its two lists left encoded: the same wire form and
    # the same checks on step, slot and rows (see ReadyDecoder).
    step: Step
    slot: Count
    rows: Count
    request_ids: msgspec.Raw
    num_drafts: msgspec.Raw


WriterMessage = Welcome | BitmaskReady | BitmaskFrame | Shutdown | Bye
ReaderMessage = Hello | Release | Bye


def reader_decoder() -> msgspec.msgpack.Decoder:
    """Decoder for a reader's socket: only messages a writer may send.

    Returns
    -------
    msgspec.msgpack.Decoder
        Decodes one frame into a :data:`WriterMessage`; raises
        ``msgspec.DecodeError`` (or its subclass ``ValidationError``) on any
        other input.
    """
    return msgspec.msgpack.Decoder(WriterMessage)


class ReadyDecoder:
    """Typed decoder for one :class:`BitmaskReady` after another.

    Decodes exactly what ``msgspec.msgpack.Decoder(BitmaskReady)`` decodes
    and raises what it raises, but decodes the request ids and draft counts
    only when their bytes differ from the last ones that decoded.

    NOTE: decoding 256 request ids costs ~30 us, an eighth of copying the
    step's mask, and the batch rarely changes between two steps. The head
    (step, slot, rows) is always decoded with its checks, the two lists are
    kept as raw msgpack and compared with the last batch; equal bytes
    decode to equal, already-checked values, so reusing them checks nothing
    less.
    """

    def __init__(self) -> None:
        self._head = msgspec.msgpack.Decoder(_ReadyHead)
        self._full = msgspec.msgpack.Decoder(BitmaskReady)
        # The last batch that decoded: its raw bytes and its values.
        self._raw: tuple[msgspec.Raw, msgspec.Raw] | None = None
        self._batch: tuple[tuple[str, ...], tuple[int, ...]] = ((), ())

    def decode(self, data: bytes | memoryview) -> BitmaskReady:
        """Decode one encoded ``BitmaskReady``.

        Raises
        ------
        msgspec.DecodeError
            (or its subclass ``ValidationError``) on anything that is not a
            valid ``BitmaskReady``.
        """
        head = self._head.decode(data)
        if (head.request_ids, head.num_drafts) == self._raw:
            return BitmaskReady(head.step, head.slot, head.rows, *self._batch)
        message = self._full.decode(data)
        # Copies: the raw views may point into a buffer the caller reuses.
        self._raw = (head.request_ids.copy(), head.num_drafts.copy())
        self._batch = (message.request_ids, message.num_drafts)
        return message


def writer_decoder() -> msgspec.msgpack.Decoder:
    """Decoder for the writer's socket: only messages a reader may send.

    Returns
    -------
    msgspec.msgpack.Decoder
        Decodes one frame into a :data:`ReaderMessage`; raises
        ``msgspec.DecodeError`` on any other input.
    """
    return msgspec.msgpack.Decoder(ReaderMessage)


def valid_reader_name(name: str) -> bool:
    """Whether ``name`` may name a reader (see :data:`READER_NAME_PATTERN`)."""
    return isinstance(name, str) and re.fullmatch(READER_NAME_PATTERN, name) is not None
