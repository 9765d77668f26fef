"""The slab files of one NVMe store: creation, preallocation, descriptors, durability.

Slab ``i`` is ``<store>/slabs/slab-<i>.dat``, preallocated to its full size on first use
(``posix_fallocate``, so a full disk shows up when space is taken, not in the middle of a
page write). Each slab is opened once; with O_DIRECT when the file system allows it
(probed once per store), buffered otherwise (tmpfs on older kernels, some network file
systems): the on-disk format is the same either way.

Thread-safety: :meth:`SlabFiles.ensure` and :meth:`SlabFiles.sync` may run on worker
threads concurrently; descriptor creation is serialised by a lock.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from kvtier.backends.nvme_layout import BLOCK, SlotLayout, aligned_empty
from kvtier.backends.store_files import Modes, open_private, private_dir

SLAB_DIR = "slabs"


def slab_path(root: Path, slab: int) -> Path:
    """Path of slab file ``slab`` of the store at ``root``."""
    return root / SLAB_DIR / f"slab-{slab:05d}.dat"


def slab_index(name: str) -> int | None:
    """The index of a slab file name (``slab-00003.dat`` -> 3), ``None`` for other names."""
    if not (name.startswith("slab-") and name.endswith(".dat")):
        return None
    digits = name[len("slab-") : -len(".dat")]
    return int(digits) if digits.isdigit() and digits.isascii() else None


def probe_direct_io(directory: Path, modes: Modes | None = None) -> tuple[str | None, bool]:
    """Check O_DIRECT in ``directory``: ``(None, dsync)`` when it works, else
    ``(why not, False)``. ``dsync`` tells whether ``pwritev(..., RWF_DSYNC)`` works there
    too (each write durable on return: no separate ``fdatasync`` needed).

    Opens, writes and reads one aligned block of a scratch file, which is removed.
    """
    if not hasattr(os, "O_DIRECT"):
        return "O_DIRECT is not supported on this platform", False
    probe = directory / ".direct-io-probe"
    buf = aligned_empty(BLOCK)
    try:
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT
        fd = open_private(probe, flags, modes or Modes(), directory)
    except OSError as exc:
        return f"O_DIRECT open failed: {exc.strerror}", False
    try:
        os.pwritev(fd, [buf.data], 0)
        os.preadv(fd, [buf.data], 0)
    except OSError as exc:
        os.close(fd)
        probe.unlink(missing_ok=True)
        return f"O_DIRECT I/O failed: {exc.strerror}", False
    dsync = hasattr(os, "RWF_DSYNC")
    if dsync:
        try:
            os.pwritev(fd, [buf.data], 0, os.RWF_DSYNC)
        except OSError:
            dsync = False
    os.close(fd)
    probe.unlink(missing_ok=True)
    return None, dsync


class SlabFiles:
    """Open descriptors of one store's slab files.

    Args:
        root: the store directory.
        layout: slot geometry.
        direct: open slabs with O_DIRECT.
        dsync: writes through these descriptors use ``RWF_DSYNC`` (direct only): each is
            durable when it returns, so :meth:`sync` has nothing left to do.
    """

    def __init__(
        self,
        root: Path,
        layout: SlotLayout,
        direct: bool,
        dsync: bool = False,
        modes: Modes | None = None,
    ) -> None:
        self.root = root
        self.layout = layout
        self.direct = direct
        self.dsync = direct and dsync
        self.modes = modes or Modes()
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        # Private, and never a symlink (UnsafeStoreError): page data goes nowhere else.
        if not private_dir(root / SLAB_DIR, self.modes, root, create=False):
            private_dir(root / SLAB_DIR, self.modes, root)
            fsync_dir(root)
        flags = os.O_RDONLY
        for slab in self.existing():  # each checked and given private modes now, not at its
            os.close(open_private(slab_path(root, slab), flags, self.modes, root))  # first I/O

    def existing(self) -> list[int]:
        """Indices of the slab files present on disk."""
        out = []
        for p in (self.root / SLAB_DIR).glob("slab-*.dat"):
            index = slab_index(p.name)
            if index is not None:
                out.append(index)
        return sorted(out)

    def fd(self, slab: int) -> int:
        """Descriptor of an existing slab (opened on first use).

        Raises :class:`OSError` when the file is missing or cannot be opened.
        """
        fd = self._fds.get(slab)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._fds.get(slab)
            if fd is None:
                flags = os.O_RDWR | (os.O_DIRECT if self.direct else 0)
                fd = open_private(slab_path(self.root, slab), flags, self.modes, self.root)
                self._fds[slab] = fd
            return fd

    def ensure(self, slab: int, preallocate: bool = True, slots: int | None = None) -> None:
        """Create slab ``slab`` if needed and make sure ``slots`` slots of it (default:
        the whole slab) are allocated. A slab file is never shrunk: the last slab a
        store's capacity reaches holds only the slots left, and grows when the capacity
        does.

        Without ``preallocate`` the file only gets its full length (sparse): disk space is
        then taken by page writes, which is where a full disk will show.

        A slab this call creates has its directory entry synced too, so pages made
        durable in it cannot vanish with its name on power loss.

        Raises :class:`OSError` (``ENOSPC`` when the disk is full); a slab that could not
        be allocated is removed again if this call created it.
        """
        path = slab_path(self.root, slab)
        created = not path.exists()
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.direct else 0)
        with self._lock:
            fd = self._fds.get(slab)
            if fd is None:
                fd = open_private(path, flags, self.modes, self.root)
                self._fds[slab] = fd
        per = self.layout.slots_per_slab
        size = (per if slots is None else max(1, min(slots, per))) * self.layout.slot_bytes
        try:
            if os.fstat(fd).st_size < size:
                if preallocate:
                    _allocate(fd, size)
                else:
                    os.ftruncate(fd, size)
            if created:
                fsync_dir(self.root / SLAB_DIR)
        except OSError:
            if created:
                with self._lock:
                    self._fds.pop(slab, None)
                os.close(fd)
                path.unlink(missing_ok=True)
            raise

    def check_still_there(self, slabs: Iterable[int]) -> None:
        """Raise :class:`OSError` when one of ``slabs`` (open) was removed, moved or
        replaced since it was opened (its directory deleted while the store ran, say):
        writes would go on into a file no name leads to, and every page committed there
        would be gone once the store closes."""
        for slab in set(slabs):
            path = slab_path(self.root, slab)
            held = os.fstat(self.fd(slab))
            try:
                named = os.stat(path)
            except FileNotFoundError:
                named = None
            if (
                held.st_nlink == 0
                or named is None
                or (named.st_dev, named.st_ino) != (held.st_dev, held.st_ino)
            ):
                raise OSError(
                    errno.ENOENT,
                    f"the store's slab file {str(path)!r} was removed, moved or replaced "
                    "while the store was open; pages committed now would be lost",
                )

    def sync(self, slabs: Iterable[int]) -> None:
        """``fdatasync`` each slab: after it returns, their written bytes are durable."""
        for slab in sorted(set(slabs)):
            os.fdatasync(self.fd(slab))

    def close(self) -> None:
        """Close every descriptor."""
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def fsync_dir(path: Path) -> None:
    """``fsync`` a directory: the names created in it are durable when it returns."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _allocate(fd: int, size: int) -> None:
    """Reserve ``size`` bytes of disk for ``fd``; falls back to ftruncate where the file
    system cannot preallocate (the space is then taken by the first write)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            os.ftruncate(fd, size)
        else:
            raise
