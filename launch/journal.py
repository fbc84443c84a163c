"""Durable outputs: each finished request's line on disk as it finishes.

Every stage-0 leader appends the ``OutputRecord`` of each request that ends
to its own file, and every last-stage rank appends the mask-row digests of
each request it forgets, under ``OUT/journal/attempt-N/``:

- ``outputs-rank{r}.jsonl``: one ``OutputLine`` per finished request;
- ``digests-rank{r}.jsonl``: one ``DigestLine`` per finished request.

A line is ``<crc32 of the payload, 8 hex digits> <payload JSON>\\n``, written
with one ``write`` on a file opened ``O_APPEND``: once ``append`` returns,
the line survives a SIGKILL of the process (it is in the kernel's page
cache). A thread ``fsync``s the file every ``output.fsync_s`` seconds, off
the step's critical path, so a power loss costs at most that much. A line
cut short by a kill, or damaged, fails its checksum and is dropped on
reading: its request is run again, never read back torn.

``PriorRun`` is what earlier attempts left: the requests they finished
(skipped by a resumed or restarted run, by id and input fingerprint) and
their digests (so the run's ``digests.jsonl`` and the determinism counts
cover every attempt). The final ``outputs.jsonl`` is merged from them and
the last attempt's reports.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from gramcoord.coordinator.status import PoisonRecord
from gramcoord.engine.requests import EngineRequest, OutputRecord
from gramcoord.rank_worker.session.digest import DigestRecord

JOURNAL = "journal"
_ATTEMPT = re.compile(r"attempt-(\d+)$")
_FILE = re.compile(r"(outputs|digests)-rank(\d+)\.jsonl$")


class OutputLine(msgspec.Struct, frozen=True):
    """One finished request: its input fingerprint and its output."""

    fp: str
    record: OutputRecord


class DigestLine(msgspec.Struct, frozen=True):
    """The mask rows one rank applied for one finished request: (position, digest)."""

    id: str
    rows: list[tuple[int, int]]


_encoder = msgspec.json.Encoder()
_outputs = msgspec.json.Decoder(OutputLine)
_digests = msgspec.json.Decoder(DigestLine)


def frame(payload: bytes) -> bytes:
    """``payload`` as one journal line (checksum, space, payload, newline)."""
    return b"%08x %s\n" % (zlib.crc32(payload), payload)


def unframe(line: bytes) -> bytes | None:
    """The payload of one complete journal line, or None when it is torn or damaged."""
    if not line.endswith(b"\n") or len(line) < 10 or line[8:9] != b" ":
        return None
    payload = line[9:-1]
    try:
        crc = int(line[:8], 16)
    except ValueError:
        return None
    return payload if zlib.crc32(payload) == crc else None


def attempt_dir(out_dir: Path, attempt: int) -> Path:
    return out_dir / JOURNAL / f"attempt-{attempt}"


def attempts(out_dir: Path) -> list[int]:
    """The attempts that left a journal in ``out_dir``, ascending."""
    root = out_dir / JOURNAL
    if not root.is_dir():
        return []
    found = (_ATTEMPT.match(p.name) for p in root.iterdir() if p.is_dir())
    return sorted(int(m.group(1)) for m in found if m)


class JournalWriter:
    """Appends framed lines to one file; fsyncs them in the background.

    Parameters
    ----------
    path:
        The file (created, with its folder).
    fsync_s:
        Seconds between background ``fsync`` calls; 0 fsyncs every line.
    """

    def __init__(self, path: Path, *, fsync_s: float) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._fsync_s = fsync_s
        self._dirty = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.lines = 0
        self._thread = None
        if fsync_s > 0:
            self._thread = threading.Thread(
                target=self._sync_loop, name="journal-fsync", daemon=True
            )
            self._thread.start()

    def append(self, payload: bytes) -> None:
        """Write one line now (one ``write``); it is durable against a kill on return."""
        data = frame(payload)
        with self._lock:
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            self.lines += 1
            self._dirty = True
            if self._fsync_s <= 0:
                os.fsync(self._fd)
                self._dirty = False

    def _sync_loop(self) -> None:
        while not self._stop.wait(self._fsync_s):
            self._sync()

    def _sync(self) -> None:
        # The fsync runs outside the lock: a line appended meanwhile never
        # waits for the disk (it is synced by the next round).
        with self._lock:
            if not self._dirty or self._fd < 0:
                return
            self._dirty = False
            fd = self._fd
        os.fsync(fd)

    def close(self) -> None:
        """Stop the fsync thread, fsync what is left, close the file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sync()
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def read_lines(path: Path) -> tuple[list[bytes], int]:
    """The payloads of ``path``'s intact lines, and how many lines were dropped."""
    good, dropped = [], 0
    with open(path, "rb") as f:
        for line in f:
            payload = unframe(line)
            if payload is None:
                dropped += 1
            else:
                good.append(payload)
    return good, dropped


def _decoded(path: Path, decoder: msgspec.json.Decoder) -> tuple[list, int]:
    """The decoded intact lines of ``path``, and how many lines were dropped."""
    lines, dropped = read_lines(path)
    out = []
    for payload in lines:
        try:
            out.append(decoder.decode(payload))
        except msgspec.DecodeError:
            dropped += 1
    return out, dropped


class PriorRun(msgspec.Struct, kw_only=True):
    """What earlier attempts finished, as the next attempt takes it over."""

    # request id -> (input fingerprint, output), the first line of each id.
    outputs: dict[str, OutputLine] = msgspec.field(default_factory=dict)
    # rank -> the digests it journaled.
    digests: dict[int, list[DigestRecord]] = msgspec.field(default_factory=dict)
    attempts: int = 0
    # Lines that failed their checksum or were cut short (their requests rerun).
    dropped: int = 0


def read_prior(out_dir: Path, *, before: int | None = None) -> PriorRun:
    """Every journal line of the attempts in ``out_dir`` numbered below ``before``."""
    prior = PriorRun()
    for n in attempts(out_dir):
        if before is not None and n >= before:
            continue
        prior.attempts = max(prior.attempts, n + 1)
        folder = attempt_dir(out_dir, n)
        for path in sorted(folder.iterdir()):
            m = _FILE.match(path.name)
            if not m:
                continue
            outputs = m.group(1) == "outputs"
            decoded, dropped = _decoded(path, _outputs if outputs else _digests)
            prior.dropped += dropped
            if outputs:
                for line in decoded:
                    prior.outputs.setdefault(line.record.id, line)
            else:
                rows = prior.digests.setdefault(int(m.group(2)), [])
                for d in decoded:
                    rows.extend(DigestRecord(d.id, p, g) for p, g in d.rows)
    # Digests only of requests whose output survived: the rest run again.
    for rank, rows in prior.digests.items():
        prior.digests[rank] = [r for r in rows if r.request_id in prior.outputs]
    return prior


# -- fingerprints ----------------------------------------------------------------------

# Config sections an output depends on; the layout, deadlines, transport and
# faults do not change what a request outputs.
FINGERPRINTED = ("tokenizer", "model", "sampling", "grammar", "speculative")


def config_fingerprint(config: Any) -> str:
    """A digest of the config sections every output depends on."""
    parts = {name: msgspec.to_builtins(getattr(config, name)) for name in FINGERPRINTED}
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=8).hexdigest()


def request_fingerprint(config_fp: str, req: EngineRequest) -> str:
    """A digest of everything one request's output depends on."""
    data = [config_fp, req.request_id, req.spec, req.constrained, req.prompt, req.max_tokens]
    data += [req.reference, req.error]
    text = json.dumps(data, sort_keys=True, ensure_ascii=False, default=repr)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def resume_problem(
    prior: PriorRun, requests: Sequence[EngineRequest], config_fp: str
) -> str | None:
    """Why ``prior`` cannot be resumed with this workload and config, or None."""
    by_id = {r.request_id: r for r in requests}
    for rid, line in prior.outputs.items():
        req = by_id.get(rid)
        if req is None:
            return f"request {rid!r} finished in the run being resumed is not in this workload"
        if request_fingerprint(config_fp, req) != line.fp:
            return (
                f"request {rid!r} changed since the run being resumed (its inputs, or the "
                f"config sections {', '.join(FINGERPRINTED)}); resume with the same workload "
                "and config, or start a new run"
            )
    return None


def carried_poison(
    prior: PriorRun, requests: Sequence[EngineRequest], grammar: Any, vocab: str
) -> list[PoisonRecord]:
    """Poison records for the keys earlier attempts found invalid (permanent).

    Timeouts are not carried: they expire, and the next attempt may compile
    in time. Keys come from the requests' specs, validated as admission does.
    """
    from gramcoord.rank_worker.errors import ErrorCode, SpecError
    from gramcoord.rank_worker.grammars.spec import validate_spec

    specs = {r.request_id: r.spec for r in requests}
    out, seen = [], set()
    for rid, line in prior.outputs.items():
        err = line.record.error
        if err is None or err.code != ErrorCode.grammar_invalid.name or rid not in specs:
            continue
        try:
            key = validate_spec(specs[rid], grammar, vocab=vocab).key
        except SpecError:
            continue
        if key not in seen:
            seen.add(key)
            out.append(PoisonRecord(key, int(ErrorCode.grammar_invalid), 0, err.message))
    return out


# -- writers for the step loop --------------------------------------------------------


class RankJournal:
    """One rank's journal files for one attempt (outputs and/or digests)."""

    def __init__(
        self,
        out_dir: Path,
        attempt: int,
        rank: int,
        *,
        fsync_s: float,
        fingerprints: dict[str, str],
        outputs: bool,
        digests: bool,
    ) -> None:
        folder = attempt_dir(out_dir, attempt)
        self._fps = fingerprints
        self._out = (
            JournalWriter(folder / f"outputs-rank{rank}.jsonl", fsync_s=fsync_s)
            if outputs
            else None
        )
        self._dig = (
            JournalWriter(folder / f"digests-rank{rank}.jsonl", fsync_s=fsync_s)
            if digests
            else None
        )

    def output(self, record: OutputRecord) -> None:
        """A request finished on this scheduler rank: its line, now."""
        if self._out is not None:
            fp = self._fps.get(record.id, "")
            self._out.append(_encoder.encode(OutputLine(fp, record)))

    def request_digests(self, request_id: str, rows: list[tuple[int, int]]) -> None:
        """A request ended on this last-stage rank: the digests of its rows."""
        if self._dig is not None and rows:
            self._dig.append(_encoder.encode(DigestLine(request_id, rows)))

    @property
    def lines(self) -> int:
        """Lines written so far, outputs and digests."""
        return sum(w.lines for w in (self._out, self._dig) if w is not None)

    def close(self) -> None:
        for w in (self._out, self._dig):
            if w is not None:
                w.close()
