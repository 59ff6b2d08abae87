"""A readable-while-raised file descriptor (a non-blocking pipe used as a level flag)."""

from __future__ import annotations

import os


class PipeFlag:
    """``fd`` is readable exactly while the flag is raised.

    Callers serialise ``raise_``/``lower`` themselves (the device lock), so the pipe holds
    at most one byte.
    """

    __slots__ = ("fd", "_wfd", "_up")

    def __init__(self) -> None:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self.fd = r
        self._wfd = w
        self._up = False

    def raise_(self) -> None:
        if not self._up and self._wfd >= 0:
            self._up = True
            try:
                os.write(self._wfd, b"\1")
            except BlockingIOError:  # pragma: no cover - cannot fill with one byte
                pass

    def lower(self) -> None:
        if self._up:
            self._up = False
            try:
                # one read: the pipe holds at most one byte (a second read would end
                # in BlockingIOError, an exception per lowering)
                os.read(self.fd, 4096)
            except (BlockingIOError, OSError):
                pass

    def close(self) -> None:
        for fd in (self.fd, self._wfd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:  # pragma: no cover
                    pass
        self.fd = self._wfd = -1
