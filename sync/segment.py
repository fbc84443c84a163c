"""One named POSIX shared-memory segment, mapped into this process.

This is ``multiprocessing.shared_memory.SharedMemory`` minus the resource
tracker (see :mod:`gramcoord.sync.janitor` for why): the creator registers the name
with the janitor, which removes it in every exit path, and attaching
processes register nothing, so they can neither unlink the segment nor warn
about it at exit.

:class:`~gramcoord.sync.ring.BitmaskRing` creates and attaches its segment here.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import logging
import mmap
import os
import re
import secrets

from gramcoord.sync.janitor import PREFIX, janitor

logger = logging.getLogger(__name__)

__all__ = ["Segment", "segment_name"]

_RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


def segment_name(run_id: str, label: str) -> str:
    """A fresh segment name, unique per run and per creation.

    Parameters
    ----------
    run_id
        The run's id: 1-32 characters from ``[A-Za-z0-9_-]``.
    label
        What the segment is for (same alphabet), e.g. ``"ring"``.

    Returns
    -------
    str
        ``gramcoord-<run_id>-<label>-<pid>-<random hex>``.

    Raises
    ------
    ValueError
        If ``run_id`` or ``label`` has other characters (they would end up
        in a file name).
    """
    for what, value in (("run_id", run_id), ("label", label)):
        if not _RUN_ID.match(value):
            raise ValueError(f"{what} must match [A-Za-z0-9_-]{{1,32}}, got {value!r}")
    return f"{PREFIX}-{run_id}-{label}-{os.getpid()}-{secrets.token_hex(4)}"


class Segment:
    """A mapped shared-memory segment; use :meth:`create` or :meth:`attach`.

    Attributes
    ----------
    name
        Segment name without the leading slash (``/dev/shm/<name>`` on Linux).
    size
        Mapped size in bytes.
    owner
        True for the creator, the only one that may :meth:`unlink`.
    buf
        The mapping; numpy views are built on it.
    """

    def __init__(self, name: str, buf: mmap.mmap, *, owner: bool) -> None:
        self.name = name
        self.buf: mmap.mmap | None = buf
        self.size = len(buf)
        self.owner = owner
        self._unlinked = False

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """Create a new segment readable and writable by this user only.

        Parameters
        ----------
        name
            A name from :func:`segment_name`; it must not exist yet.
        size
            Size in bytes, > 0.

        Returns
        -------
        Segment
            The owner's mapping, zero-filled.

        Raises
        ------
        FileExistsError
            If the name is taken.
        """
        if size <= 0:
            raise ValueError(f"segment size must be > 0, got {size}")
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        # Owned from the first instant, so a crash during setup cannot leak it.
        janitor().own("shm", name)
        try:
            # A umask can only remove bits, but be exact about what we promise.
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            buf = mmap.mmap(fd, size)
        except BaseException:
            janitor().disown("shm", name)
            _posixshmem.shm_unlink("/" + name)
            raise
        finally:
            os.close(fd)
        return cls(name, buf, owner=True)

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map an existing segment created by another process.

        Raises
        ------
        FileNotFoundError
            If no segment has that name (never created, or already unlinked).
        """
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            buf = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(name, buf, owner=False)

    def close(self) -> None:
        """Unmap, unless numpy views still point into the mapping.

        A live view keeps the mapping valid; it is unmapped when the last
        view is garbage-collected. Closing never invalidates memory a caller
        still holds.
        """
        buf, self.buf = self.buf, None
        if buf is None:
            return
        try:
            buf.close()
        except BufferError:
            logger.debug("segment %s still has views; unmapping when they are freed", self.name)

    def unlink(self) -> None:
        """Remove the name (owner only). Idempotent; mappings stay valid.

        Raises
        ------
        PermissionError
            If called on an attached (non-owner) segment.
        """
        if not self.owner:
            raise PermissionError(f"only the creator may unlink {self.name}")
        if self._unlinked:
            return
        self._unlinked = True
        # The janitor's signal path may have got there first.
        with contextlib.suppress(FileNotFoundError):
            _posixshmem.shm_unlink("/" + self.name)
        janitor().disown("shm", self.name)

    def __repr__(self) -> str:
        role = "owner" if self.owner else "attached"
        return f"Segment({self.name!r}, size={self.size}, {role})"
