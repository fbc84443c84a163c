"""The spec store: the specs a deployment serves, kept on disk as plain records.

Agent deployments send the same tool schemas for months, yet every restart,
scale-up or new replica would compile them all again on the request path.
The store keeps each spec an engine admitted as a small record in a
directory an operator chooses (``grammar.store.dir``): the request's spec as
JSON text, its grammar key, the vocabulary's name, its last use and how
often it was used. A compiled grammar is never stored: xgrammar's own
serialization costs about twice the compile.

At start the manager (``grammars.manager``) compiles the stored specs, most
recently used first, and those of the operator's lists
(``grammar.store.preload``), in the background; a request for one of them
joins its compile.

Every record is refused on its own, with a reason, and never stops an
engine: a file that is not a regular file, too big, not the record format,
another format version, another vocabulary (foreign), a spec that no longer
validates, or whose key no longer matches (outdated: another gramcoord
version or other grammar options). A record is decoded as typed data
(``msgspec``) and validated like any request; nothing in it is executed.
Files are written whole (a temporary file, then a rename) with mode 0600,
and the store keeps at most ``max_records`` specs, dropping the least
recently used.

Verdicts. Engines that share a directory also share their verdicts
(``share_verdicts``): a key that failed or timed out on one engine is
written as a verdict record, and the others read it within
``verdict_poll_s`` and refuse the key at once until its poison TTL ends,
instead of each burning a compile deadline. Only engines that decide alone
read them (vLLM's engines under ``--data-parallel-size``, one SGLang or
gramcoord process): in an agreement group poison changes only at agreed
points, and the group already shares it.

The disk work runs on the store's own thread (``SpecStoreThread``), never
on the engine's step: the manager hands it records to write and takes the
verdicts it read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec

from gramcoord.coordinator.status import PoisonRecord, wall_clock_ms

logger = logging.getLogger(__name__)

# The record format this gramcoord reads and writes.
FORMAT = 1
# Bytes of a record beyond its spec (key, vocabulary, counters, quoting).
_OVERHEAD = 4096
# A verdict's message is cut to this many characters.
_MESSAGE_CHARS = 512
# A record's spec is written again at most this often (its last use).
_TOUCH_S = 300.0


class SpecRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One stored spec: ``specs/<key>.json``."""

    format: int
    # Hex of the grammar key (blake2b-128).
    key: str
    # The vocabulary's name the key was made with.
    vocab: str
    # The request's structured_outputs mapping, as JSON text.
    spec: str
    last_used_ms: int
    uses: int = 1


class VerdictRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One shared verdict: ``verdicts/<key>-<reason>.json``."""

    format: int
    key: str
    vocab: str
    # rank_worker.errors code number (grammar_timeout, grammar_invalid, ...).
    reason: int
    # Wall clock of the failure, in ms: the poison TTL runs from it.
    clock_ms: int
    message: str = ""


class Stored(msgspec.Struct, frozen=True):
    """A record that passed the file checks, or a listed spec: what the manager validates next."""

    # The stored key (None for a listed spec): validation must give it again.
    key: bytes | None
    spec: Any
    last_used_ms: int
    where: str


def _read(path: Path, limit: int) -> bytes:
    """A regular file's bytes (never through a link), refused past ``limit`` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{st.st_size} bytes, past the store's {limit} per record")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"past the store's {limit} bytes per record")
        return data
    finally:
        os.close(fd)


def _write(path: Path, data: bytes) -> None:
    """Write ``data`` whole at ``path`` (0600): a temporary file beside it, then a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class SpecStore:
    """One engine's view of a store directory; see the module docstring.

    Parameters
    ----------
    root:
        The store's directory (made 0700 when missing).
    vocab:
        The engine's vocabulary name: records of another are foreign.
    max_records:
        Most spec records kept.
    max_spec_bytes:
        The grammar's spec cap; a record holds one spec and a little more.
    """

    def __init__(
        self, root: str | os.PathLike, vocab: str, *, max_records: int, max_spec_bytes: int
    ):
        self.root = Path(root)
        self.vocab = vocab
        self.max_records = max_records
        self.limit = max_spec_bytes + _OVERHEAD
        self.specs = self.root / "specs"
        self.verdicts = self.root / "verdicts"
        for d in (self.root, self.specs, self.verdicts):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        # key hex -> (last written, uses) of the records this engine wrote or read.
        self._known: dict[str, tuple[float, int]] = {}
        self._seen_verdicts: dict[str, int] = {}
        self._writes = 0
        self._spec_decoder = msgspec.json.Decoder(SpecRecord)
        self._verdict_decoder = msgspec.json.Decoder(VerdictRecord)

    # -- specs -------------------------------------------------------------

    def load(self) -> tuple[list[Stored], list[str]]:
        """The usable records, most recently used first, and a reason per refused one."""
        found: list[Stored] = []
        refused: list[str] = []
        names = self._names(self.specs)
        for name in names:
            path = self.specs / name
            try:
                record = self._spec_decoder.decode(_read(path, self.limit))
                why = self._foreign(record.format, record.vocab)
                if why is None and name != f"{record.key}.json":
                    why = "its name is not its key"
                if why is None:
                    key = bytes.fromhex(record.key)
                    spec = msgspec.json.decode(record.spec)
                    if len(key) != 16:
                        why = "a key of 16 bytes is expected"
            except (OSError, ValueError, msgspec.DecodeError) as exc:
                why = f"{type(exc).__name__}: {exc}"
            if why is not None:
                refused.append(f"{path}: {why}")
                continue
            found.append(Stored(key, spec, record.last_used_ms, str(path)))
            self._known[record.key] = (time.monotonic(), record.uses)
        found.sort(key=lambda s: -s.last_used_ms)
        return found, refused

    def _names(self, folder: Path) -> list[str]:
        """The record names in ``folder``, a bounded number of them."""
        out: list[str] = []
        with contextlib.suppress(OSError), os.scandir(folder) as it:
            for entry in it:
                if entry.name.endswith(".json") and not entry.name.startswith("."):
                    out.append(entry.name)
                    if len(out) >= 4 * self.max_records:
                        break
        return sorted(out)

    def _foreign(self, fmt: int, vocab: str) -> str | None:
        if fmt != FORMAT:
            return f"record format {fmt}; this gramcoord reads format {FORMAT} (outdated)"
        if vocab != self.vocab:
            return f"foreign: made for vocabulary {vocab!r}, this engine's is {self.vocab!r}"
        return None

    def used(self, key: bytes, spec: Any) -> bool:
        """Keep ``spec`` (the request's mapping) as used now; whether a file was written.

        A record already written is written again only after ``_TOUCH_S``.
        """
        name = key.hex()
        written, uses = self._known.get(name, (None, 0))
        now = time.monotonic()
        if written is not None and now - written < _TOUCH_S:
            self._known[name] = (written, uses + 1)
            return False
        try:
            text = spec if isinstance(spec, str) else msgspec.json.encode(spec).decode()
        except (TypeError, ValueError, OverflowError):
            return False
        record = SpecRecord(
            format=FORMAT,
            key=name,
            vocab=self.vocab,
            spec=text,
            last_used_ms=wall_clock_ms(),
            uses=uses + 1,
        )
        data = msgspec.json.encode(record)
        if len(data) > self.limit:
            return False
        _write(self.specs / f"{name}.json", data)
        self._known[name] = (now, uses + 1)
        self._bound(self.specs)
        return True

    def _bound(self, folder: Path) -> None:
        """Drop the oldest records of ``folder`` past ``max_records`` (every 64th write)."""
        self._writes += 1
        if self._writes % 64 and len(self._known) <= self.max_records:
            return
        entries = []
        with contextlib.suppress(OSError), os.scandir(folder) as it:
            for entry in it:
                if entry.name.endswith(".json") and not entry.name.startswith("."):
                    with contextlib.suppress(OSError):
                        entries.append((entry.stat(follow_symlinks=False).st_mtime, entry.name))
        entries.sort()
        for _, name in entries[: max(0, len(entries) - self.max_records)]:
            with contextlib.suppress(OSError):
                (folder / name).unlink()
            if folder == self.specs:
                self._known.pop(name[: -len(".json")], None)

    @staticmethod
    def _mtime_ms(path: Path) -> int:
        return int(os.stat(path, follow_symlinks=False).st_mtime_ns // 1_000_000)

    # -- verdicts ----------------------------------------------------------

    def put_verdict(self, record: PoisonRecord) -> None:
        """Share one failed key with the other engines on this store."""
        verdict = VerdictRecord(
            format=FORMAT,
            key=record.key.hex(),
            vocab=self.vocab,
            reason=record.reason,
            clock_ms=record.clock_ms,
            message=record.message[:_MESSAGE_CHARS],
        )
        name = f"{verdict.key}-{verdict.reason}.json"
        _write(self.verdicts / name, msgspec.json.encode(verdict))
        with contextlib.suppress(OSError):  # this engine's own: never read back
            self._seen_verdicts[name] = self._mtime_ms(self.verdicts / name)
        self._bound(self.verdicts)

    def read_verdicts(self) -> tuple[list[PoisonRecord], list[str]]:
        """Verdicts of the other engines not read before, and the refused ones."""
        out: list[PoisonRecord] = []
        refused: list[str] = []
        for name in self._names(self.verdicts):
            path = self.verdicts / name
            try:
                mtime_ms = self._mtime_ms(path)
            except OSError:
                continue
            if self._seen_verdicts.get(name) == mtime_ms:
                continue
            self._seen_verdicts[name] = mtime_ms
            try:
                v = self._verdict_decoder.decode(_read(path, _OVERHEAD + 4 * _MESSAGE_CHARS))
                why = self._foreign(v.format, v.vocab)
                key = bytes.fromhex(v.key)
                if why is None and (len(key) != 16 or name != f"{v.key}-{v.reason}.json"):
                    why = "its name is not its key and reason"
            except (OSError, ValueError, msgspec.DecodeError) as exc:
                why = f"{type(exc).__name__}: {exc}"
            if why is not None:
                refused.append(f"{path}: {why}")
                continue
            out.append(PoisonRecord(key, v.reason, v.clock_ms, v.message[:_MESSAGE_CHARS]))
        return out, refused


def read_preload_list(path: str, max_spec_bytes: int) -> tuple[list[tuple[int, Any]], list[str]]:
    """An operator's list: one ``structured_outputs`` mapping per line (JSON lines).

    Returns the decoded specs with their line numbers and a reason per
    refused line; a missing or unreadable file is one refusal, never an
    exception.
    """
    specs: list[tuple[int, Any]] = []
    refused: list[str] = []
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        return [], [f"{path}: {type(exc).__name__}: {exc}"]
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        if len(line) > max_spec_bytes:
            refused.append(f"{path}:{n}: {len(line)} bytes, past max_spec_bytes")
            continue
        try:
            specs.append((n, msgspec.json.decode(line)))
        except msgspec.DecodeError as exc:
            refused.append(f"{path}:{n}: {exc}")
    return specs, refused


def gather(
    store: SpecStore | None, lists: Iterable[str], max_spec_bytes: int
) -> tuple[list[Stored], list[str]]:
    """What a warm start compiles: the store's usable records, most recently
    used first, then the operator's lists; and a reason per refused one."""
    specs: list[Stored] = []
    refused: list[str] = []
    if store is not None:
        found, why = store.load()
        specs += found
        refused += why
    for path in lists:
        listed, why = read_preload_list(path, max_spec_bytes)
        specs += [Stored(None, spec, 0, f"{path}:{n}") for n, spec in listed]
        refused += why
    return specs, refused


class SpecStoreThread:
    """The store's disk work, on one low-priority thread, off the engine's step.

    At start it runs ``warm(specs)`` once, with the store's usable records and
    the operator's lists (the manager compiles them there); then it writes
    the records the engine hands it (``used``, ``failed``) and, with
    verdicts shared, reads the other engines' verdicts every ``poll_s``
    into ``take_verdicts``.
    """

    def __init__(
        self,
        store: SpecStore | None,
        preload: Iterable[str],
        *,
        max_spec_bytes: int,
        warm: Callable[[list[Stored]], None],
        read_verdicts: bool,
        poll_s: float,
    ) -> None:
        self.store = store
        self._lists = tuple(preload)
        self._max_spec_bytes = max_spec_bytes
        self._warm = warm
        self._read_verdicts = read_verdicts and store is not None
        self._poll_s = poll_s
        self._writes: deque[tuple[str, Any]] = deque()
        self._verdicts: deque[PoisonRecord] = deque()
        self._wake = threading.Event()
        self._stop = False
        self.warmed = threading.Event()
        self.refused: list[str] = []
        self._thread = threading.Thread(target=self._run, name="gramcoord-spec-store", daemon=True)

    def start(self) -> None:
        """Start the thread (its owner holds this object first: ``warm`` may use it)."""
        self._thread.start()

    def used(self, key: bytes, spec: Any) -> None:
        """A request with ``spec`` was admitted (its record is written on the thread)."""
        if self.store is not None:
            self._writes.append(("used", (key, spec)))
            self._wake.set()

    def failed(self, records: Iterable[PoisonRecord]) -> None:
        """Keys this engine poisoned, for the other engines on the store."""
        if self.store is not None:
            for r in records:
                self._writes.append(("failed", r))
            self._wake.set()

    def take_verdicts(self) -> list[PoisonRecord]:
        """The other engines' verdicts read since the last call."""
        out = []
        while self._verdicts:
            out.append(self._verdicts.popleft())
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued and stop the thread (a compile it runs is not waited for)."""
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        lowest_priority()
        try:
            self._warm(self._gather())
            if self._read_verdicts:  # the verdicts at start hold before the first request
                self._poll()
        except Exception:  # the engine serves on without its warm start
            logger.exception("gramcoord spec store: the warm start failed")
        finally:
            self.warmed.set()
        next_poll = time.monotonic() + self._poll_s
        while True:
            self._drain()
            if self._stop:
                return
            now = time.monotonic()
            if self._read_verdicts and now >= next_poll:
                self._poll()
                next_poll = now + self._poll_s
            self._wake.wait(self._poll_s if self._read_verdicts else None)
            self._wake.clear()

    def _gather(self) -> list[Stored]:
        specs, refused = gather(self.store, self._lists, self._max_spec_bytes)
        self._refuse(refused)
        return specs

    def refuse(self, where: str, why: str) -> None:
        """A stored or listed spec the manager refused (it no longer validates, say)."""
        self._refuse([f"{where}: {why}"])

    def _refuse(self, reasons: list[str]) -> None:
        for why in reasons:
            logger.warning("gramcoord spec store: record refused: %s", why)
        self.refused.extend(reasons)

    def _drain(self) -> None:
        assert self.store is not None or not self._writes
        while self._writes:
            what, item = self._writes.popleft()
            try:
                if what == "used":
                    self.store.used(*item)
                else:
                    self.store.put_verdict(item)
            except OSError as exc:
                logger.warning("gramcoord spec store: cannot write %s: %s", self.store.root, exc)

    def _poll(self) -> None:
        assert self.store is not None
        records, refused = self.store.read_verdicts()
        self._refuse(refused)
        self._verdicts.extend(records)


def lowest_priority() -> None:
    """Nice 19 for the calling thread (Linux: nice is per thread); a no-op elsewhere."""
    if hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
