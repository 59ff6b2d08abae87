"""The memory regions a comm registers to send large frames from where they lie.

A rendezvous send names the region its bytes lie in when it is queued: the endpoint
takes the region of its own table that contains them (``aiordma.Endpoint.send``), and
the peer READs with that region's key until the send completes. Writes return before
their sends complete, so one comm may have several in flight, and two may send the
same memory (the same array twice, or a slice of an array being sent): a region one
write registered may then be the one another write's send uses. So a write *holds*
every region of the comm that contains a frame it sends -- registering one only when
none does -- and a region is deregistered when the last write holding it is done.
(A region registered later for memory that contains an earlier write's frame may be
taken by that write's send too; its own writes complete after the earlier one, since
an endpoint completes sends in order.)
"""

from __future__ import annotations

import ctypes
from typing import Any

import aiordma


def _span(mv: memoryview) -> tuple[int, int]:
    """``(address, length)`` of a writable, contiguous byte view."""
    n = mv.nbytes
    return ctypes.addressof((ctypes.c_char * n).from_buffer(mv)), n


class SendRegions:
    """The send regions of one endpoint, each with the count of writes holding it."""

    def __init__(self, ep: aiordma.Endpoint) -> None:
        self._ep = ep
        self._held: dict[int, list[Any]] = {}  # id(region) -> [region, holders]

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, frames: list[memoryview]) -> list[aiordma.MemoryRegion]:
        """Hold, for one write, every region containing each of ``frames`` (writable
        views), registering a remotely readable one for a frame that none contains.
        Returns the regions held (give them to ``release``). Raises what
        ``Endpoint.register`` raises; nothing stays held then."""
        held: list[aiordma.MemoryRegion] = []
        try:
            for mv in frames:
                addr, n = _span(mv)
                found = [entry for entry in self._held.values()
                         if entry[0].addr <= addr and addr + n <= entry[0].addr + entry[0].length]
                if not found:
                    region = self._ep.register(mv, remote_read=True)
                    found = [[region, 0]]
                    self._held[id(region)] = found[0]
                for entry in found:
                    if entry[0] not in held:
                        entry[1] += 1
                        held.append(entry[0])
        except BaseException:
            self.release(held)
            raise
        return held

    def release(self, regions: list[aiordma.MemoryRegion]) -> None:
        """One write is done with ``regions``: deregister those nobody holds any more."""
        for region in regions:
            entry = self._held.get(id(region))
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] <= 0:
                del self._held[id(region)]
                region.close()

    def close(self) -> None:
        """Deregister every region (the endpoint is gone or going)."""
        held, self._held = self._held, {}
        for region, _count in held.values():
            region.close()
