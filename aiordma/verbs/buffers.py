"""Buffer-protocol helpers: the address of a writable buffer, kept pinned by a view."""

from __future__ import annotations

import ctypes
from typing import Any


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
