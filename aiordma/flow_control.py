"""Write flow control of a transport, as asyncio's (``_FlowControlMixin`` in
Lib/asyncio/transports.py), thresholds and error texts included: ``pause_writing()``
once the write buffer grows above the high-water mark, ``resume_writing()`` once it is
at or below the low one (defaults: 64 KiB, and a quarter of the high mark). An
exception from either callback goes to the loop's exception handler."""

from __future__ import annotations

import asyncio
from typing import Any


class WriteFlowControl(asyncio.Transport):
    """A transport base with asyncio's write flow control. The subclass sets
    ``_loop`` and ``_protocol`` before calling ``__init__``, defines
    ``get_write_buffer_size()``, and calls ``_maybe_pause_protocol()`` after the buffer
    grew and ``_maybe_resume_protocol()`` after it shrank."""

    _loop: asyncio.AbstractEventLoop
    _protocol: Any

    def __init__(self, extra: dict[str, Any] | None = None) -> None:
        super().__init__(extra)
        self._protocol_paused = False
        self._high_water = 0
        self._low_water = 0
        self._set_write_buffer_limits()

    def _maybe_pause_protocol(self) -> None:
        size = self.get_write_buffer_size()
        if size <= self._high_water:
            return
        if not self._protocol_paused:
            self._protocol_paused = True
            try:
                self._protocol.pause_writing()
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._loop.call_exception_handler({
                    "message": "protocol.pause_writing() failed",
                    "exception": exc,
                    "transport": self,
                    "protocol": self._protocol,
                })

    def _maybe_resume_protocol(self) -> None:
        if self._protocol_paused and self.get_write_buffer_size() <= self._low_water:
            self._protocol_paused = False
            try:
                self._protocol.resume_writing()
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._loop.call_exception_handler({
                    "message": "protocol.resume_writing() failed",
                    "exception": exc,
                    "transport": self,
                    "protocol": self._protocol,
                })

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (self._low_water, self._high_water)

    def _set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = 64 * 1024 if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high_water = high
        self._low_water = low

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._set_write_buffer_limits(high=high, low=low)
        self._maybe_pause_protocol()
