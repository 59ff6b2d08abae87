"""Buffer-protocol helpers: the address of a writable buffer, kept pinned by a view;
memory that another process of this host can map (``SharedMemory``)."""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import mmap
import os
import threading
from typing import Any, ClassVar


class PinnedBuffer:
    """A writable, C-contiguous byte view of a buffer-protocol object and its address.

    Holding a ``PinnedBuffer`` holds a buffer export on the object: a ``bytearray``
    cannot be resized and an ``mmap`` cannot be closed while it lives. ``release()``
    drops the export (idempotent).

    Raises ``TypeError`` for read-only or non-contiguous buffers and for objects that do
    not support the buffer protocol.
    """

    __slots__ = ("view", "addr", "length", "_carray")

    def __init__(self, obj: Any) -> None:
        try:
            mv = memoryview(obj)
        except TypeError:
            raise TypeError(
                f"a bytes-like object supporting the buffer protocol is required, not "
                f"{type(obj).__name__!r}"
            ) from None
        if mv.readonly:
            mv.release()
            raise TypeError(f"a writable buffer is required, {type(obj).__name__!r} is read-only")
        if not mv.c_contiguous:
            mv.release()
            raise TypeError("a C-contiguous buffer is required")
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        self.view: memoryview = mv
        self.length: int = mv.nbytes
        if self.length:
            self._carray: Any = (ctypes.c_char * self.length).from_buffer(mv)
            self.addr: int = ctypes.addressof(self._carray)
        else:
            self._carray = None
            self.addr = 0

    def release(self) -> None:
        self._carray = None
        try:
            self.view.release()
        except ValueError:  # still exported by a slice someone holds
            pass

    def __repr__(self) -> str:
        return f"<PinnedBuffer addr={self.addr:#x} length={self.length}>"


# --- memory that other processes of this host can map -------------------------------------

#: most ``SharedMemory`` buffers alive in this process at once (each holds a file
#: descriptor); beyond it ``SharedMemory.create`` returns None and callers use private memory
SHARED_MAX_BUFFERS = 128


class SharedMemory:
    """Anonymous memory that another process of this host may map: a sealed ``memfd``.

    ``create(size)`` returns one, or None where memfds are not available (not Linux,
    old kernel) or ``SHARED_MAX_BUFFERS`` are alive. ``map`` is the ``mmap`` to register
    and use; ``fd`` stays open (a peer opens ``/proc/<pid>/fd/<fd>`` to map the same
    pages) and ``ino`` names the memory uniquely while anything maps it. The size is
    sealed (``F_SEAL_SHRINK | F_SEAL_GROW``): a peer that maps it can never fault on a
    truncated page. ``backing(addr, length)`` finds the live buffer holding a range.
    ``close()`` unmaps and closes the fd (idempotent; the memory lives on while a peer
    still maps it).
    """

    __slots__ = ("fd", "ino", "size", "map", "addr", "_carray")

    _live: ClassVar[dict[int, SharedMemory]] = {}  # addr -> buffer
    _bases: ClassVar[list[int]] = []  # sorted addrs of _live
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, fd: int, size: int, mp: mmap.mmap) -> None:
        self.fd = fd
        self.ino = os.fstat(fd).st_ino
        self.size = size
        self.map = mp
        self._carray: Any = (ctypes.c_char * size).from_buffer(mp)
        self.addr = ctypes.addressof(self._carray)

    @classmethod
    def create(cls, size: int) -> SharedMemory | None:
        if size <= 0 or not hasattr(os, "memfd_create") or not hasattr(fcntl, "F_ADD_SEALS"):
            return None
        with cls._lock:
            if len(cls._live) >= SHARED_MAX_BUFFERS:
                return None
            try:
                fd = os.memfd_create("aiordma-shared", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            except OSError:
                return None
            try:
                os.ftruncate(fd, size)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                            | fcntl.F_SEAL_SEAL)
                sm = cls(fd, size, mmap.mmap(fd, size))
            except (OSError, ValueError):
                os.close(fd)
                return None
            cls._live[sm.addr] = sm
            bisect.insort(cls._bases, sm.addr)
            return sm

    @classmethod
    def backing(cls, addr: int, length: int) -> tuple[SharedMemory, int] | None:
        """``(buffer, offset)`` when ``[addr, addr + length)`` lies in one live buffer."""
        bases = cls._bases
        i = bisect.bisect_right(bases, addr) - 1
        if i < 0:
            return None
        sm = cls._live.get(bases[i])
        if sm is None:
            return None
        off = addr - sm.addr
        return (sm, off) if off + length <= sm.size else None

    def close(self) -> None:
        with SharedMemory._lock:
            if SharedMemory._live.get(self.addr) is not self:
                return
            del SharedMemory._live[self.addr]
            SharedMemory._bases.remove(self.addr)
        self._carray = None
        try:
            self.map.close()
        except BufferError:  # still exported (a registration someone leaked): unmapped when freed
            pass
        os.close(self.fd)

    def __repr__(self) -> str:
        return f"<SharedMemory fd={self.fd} ino={self.ino} addr={self.addr:#x} size={self.size}>"
