"""Registered memory: user regions, remote descriptors, and pre-registered pools.

* ``MemoryRegion``: a user buffer registered with one endpoint's PD (``ep.register``).
  ``remote()`` makes the ``RemoteBuffer`` descriptor a peer needs for one-sided access.
* ``RemoteBuffer``: (addr, rkey, length) with a fixed 20-byte wire form.
* ``RegionTable``: finds the registered region that contains a local buffer, so a slice
  of a registered buffer can be passed to ``ep.write``/``ep.read`` without registering
  again; anything else is refused with ``ValueError`` before posting.
* ``SlotPool``: one page-aligned ``mmap`` arena of fixed-size slots, registered once,
  for eager sends and pre-posted receives (no registration per message).
* ``StagingCache``: registered page-aligned buffers in power-of-two size classes for
  rendezvous transfers, created on first use and then reused.
"""

from __future__ import annotations

import bisect
import dataclasses
import mmap
import struct
from typing import Any, ClassVar, Final

from .native import mypyc_attr
from .protocol.engine import Slots
from .verbs import MR, PD, Access
from .verbs.buffers import PinnedBuffer, SharedMemory

_REMOTE: Final = struct.Struct("<QIQ")


@mypyc_attr(native_class=False)  # a ClassVar in a slotted frozen dataclass
@dataclasses.dataclass(frozen=True, slots=True)
class RemoteBuffer:
    """A peer's registered range: ``addr``, ``rkey``, ``length``. Immutable, hashable.

    Raises ValueError for fields outside u64/u32/u64.
    """

    addr: int
    rkey: int
    length: int

    PACKED_SIZE: ClassVar[int] = _REMOTE.size

    def __post_init__(self) -> None:
        if not (0 <= self.addr < 1 << 64 and 0 <= self.rkey < 1 << 32
                and 0 <= self.length < 1 << 64):
            raise ValueError(f"RemoteBuffer fields out of range: addr={self.addr}, "
                             f"rkey={self.rkey}, length={self.length}")

    def pack(self) -> bytes:
        """The 20-byte wire form (little-endian addr u64, rkey u32, length u64)."""
        return _REMOTE.pack(self.addr, self.rkey, self.length)

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> RemoteBuffer:
        """Parse ``pack()``'s output. Raises ValueError unless exactly 20 bytes."""
        if len(data) != _REMOTE.size:
            raise ValueError(f"RemoteBuffer needs {_REMOTE.size} bytes, got {len(data)}")
        return cls(*_REMOTE.unpack(data))

    def slice(self, offset: int, length: int | None = None) -> RemoteBuffer:
        """A sub-range. Raises ValueError when it leaves this range."""
        if length is None:
            length = self.length - offset
        if offset < 0 or length < 0 or offset + length > self.length:
            raise ValueError(f"range [{offset}, {offset}+{length}) outside remote buffer of {self.length}")
        return RemoteBuffer(self.addr + offset, self.rkey, length)

    def __repr__(self) -> str:
        return f"RemoteBuffer(addr={self.addr:#x}, rkey={self.rkey:#x}, length={self.length})"


class MemoryRegion:
    """A user buffer registered with an endpoint's protection domain.

    ``view`` is a byte memoryview of the whole buffer. Remote rights are exactly those
    asked for at registration. ``close()`` deregisters (idempotent): a peer holding its
    rkey gets ``RemoteAccessError`` from then on.
    """

    def __init__(self, mr: MR, table: RegionTable | None = None) -> None:
        self._mr = mr
        self._table = table
        self.addr = mr.addr
        self.length = mr.length
        self.lkey = mr.lkey
        self.rkey = mr.rkey
        self.access = mr.access
        self.view = mr.view
        self.closed = False

    def remote(self, offset: int = 0, length: int | None = None) -> RemoteBuffer:
        """The descriptor of ``[offset, offset+length)`` for a peer.

        Raises ValueError for a range outside the region, RuntimeError if closed or if
        the region grants no remote right.
        """
        if self.closed:
            raise RuntimeError("memory region is closed")
        if not self.access & (Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC):
            raise RuntimeError("region grants no remote access; register with remote_read/"
                               "remote_write/remote_atomic=True")
        if length is None:
            length = self.length - offset
        if offset < 0 or length < 0 or offset + length > self.length:
            raise ValueError(f"range [{offset}, {offset}+{length}) outside region of {self.length} bytes")
        return RemoteBuffer(self.addr + offset, self.rkey, length)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._table is not None:
            self._table.remove(self)
        self._mr.close()

    def __enter__(self) -> MemoryRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"lkey={self.lkey:#x} rkey={self.rkey:#x}"
        return f"<MemoryRegion addr={self.addr:#x} length={self.length} {state}>"


class LocalSpan:
    """A resolved local range: address, length, lkey, and what to keep alive."""

    __slots__ = ("addr", "length", "lkey", "keep")

    def __init__(self, addr: int, length: int, lkey: int, keep: Any) -> None:
        self.addr = addr
        self.length = length
        self.lkey = lkey
        self.keep = keep


class RegionTable:
    """The registered regions of one endpoint, searchable by address."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._regions: list[MemoryRegion] = []

    def add(self, region: MemoryRegion) -> None:
        i = bisect.bisect_right(self._starts, region.addr)
        self._starts.insert(i, region.addr)
        self._regions.insert(i, region)

    def remove(self, region: MemoryRegion) -> None:
        for i, r in enumerate(self._regions):
            if r is region:
                del self._starts[i]
                del self._regions[i]
                return

    def regions(self) -> list[MemoryRegion]:
        return list(self._regions)

    def resolve(self, obj: Any, *, writable: bool) -> LocalSpan:
        """The span of ``obj``: a MemoryRegion or a buffer inside a registered region.

        Raises TypeError for a non-buffer (or a read-only one when ``writable``) and
        ValueError for a closed region or memory that no open region of this endpoint
        contains.
        """
        if isinstance(obj, MemoryRegion):
            if obj.closed:
                raise ValueError("memory region is closed")
            if obj._table is not self:
                raise ValueError("memory region belongs to another endpoint")
            return LocalSpan(obj.addr, obj.length, obj.lkey, obj)
        try:
            pb = PinnedBuffer(obj)
        except TypeError:
            if writable:
                raise
            pb = None
        if pb is None:
            raise ValueError("buffer is not registered with this endpoint; use ep.register()")
        addr, length = pb.addr, pb.length
        i = bisect.bisect_right(self._starts, addr) - 1
        while i >= 0:
            r = self._regions[i]
            if r.addr <= addr and addr + length <= r.addr + r.length:
                return LocalSpan(addr, length, r.lkey, (pb, r))
            if r.addr + r.length < addr:
                break
            i -= 1
        if length == 0:
            return LocalSpan(addr, 0, 0, pb)
        pb.release()
        raise ValueError("buffer is not registered with this endpoint; use ep.register()")


def _page_round(n: int) -> int:
    page = mmap.PAGESIZE
    return max(page, (n + page - 1) // page * page)


@mypyc_attr(native_class=False)  # (its base is the compiled engine's: not a mypyc class)
class SlotPool(Slots):
    """``count`` slots of ``slot_size`` bytes in one page-aligned registered mmap
    (``Slots``: acquire and release; ``mr``: the registration). Raises ValueError for a
    non-positive size or count, RDMAError when the registration fails."""

    def __init__(self, pd: PD, slot_size: int, count: int, access: Access = Access.LOCAL_WRITE) -> None:
        if slot_size <= 0 or count <= 0:
            raise ValueError("slot_size and count must be positive")
        self._map = mmap.mmap(-1, _page_round(slot_size * count))
        self.mr = pd.reg_mr(self._map, access)
        super().__init__(self.mr.view, self.mr.addr, self.mr.lkey, slot_size, count)

    def bytes_at(self, offset: int, length: int) -> bytes:
        """``Slots.bytes_at``, sliced from the mapping itself: one bytes object, no
        view in between."""
        return self._map[offset: offset + length]

    def close(self) -> None:
        self.forget_memory()
        self.mr.close()
        try:
            self._map.close()
        except BufferError:  # a view escaped; the mapping is freed with it
            pass


class Staging:
    """One leased staging buffer of a ``StagingCache`` (``length`` bytes are in use).
    ``shared``: the ``SharedMemory`` behind ``map``, or None for private memory."""

    __slots__ = ("cache", "mr", "map", "length", "size_class", "shared")

    def __init__(self, cache: StagingCache, mr: MR, mp: mmap.mmap, size_class: int,
                 shared: SharedMemory | None = None) -> None:
        self.cache = cache
        self.mr = mr
        self.map = mp
        self.size_class = size_class
        self.length = 0
        self.shared = shared

    @property
    def view(self) -> memoryview:
        return self.mr.view[: self.length]

    def release(self) -> None:
        self.cache._give_back(self)


class StagingCache:
    """Registered page-aligned buffers in power-of-two size classes (>= 64 KiB).

    ``lease(n)`` returns a ``Staging`` of at least ``n`` bytes, registered with
    ``access`` once, when first created; released buffers are kept (up to
    ``max_cached_bytes`` in all) for the next lease. ``shared``: buffers are
    ``SharedMemory`` (while the process may create more; private memory after that), so
    that a same-host peer of a provider that ``maps_shared_memory`` fills them with a
    plain copy.
    """

    MIN_CLASS: ClassVar[int] = 1 << 16

    def __init__(self, pd: PD, access: Access, max_cached_bytes: int = 256 << 20,
                 shared: bool = False) -> None:
        self._pd = pd
        self._access = access
        self._max = max_cached_bytes
        self._shared = shared
        self._free: dict[int, list[Staging]] = {}
        self._cached = 0
        self._closed = False
        self.registrations = 0

    def lease(self, n: int) -> Staging:
        size = self.MIN_CLASS
        while size < n:
            size <<= 1
        free = self._free.get(size)
        if free:
            st = free.pop()
            self._cached -= size
        else:
            sm = SharedMemory.create(size) if self._shared else None
            mp = sm.map if sm is not None else mmap.mmap(-1, size)
            try:
                mr = self._pd.reg_mr(mp, self._access)
            except BaseException:
                if sm is not None:
                    sm.close()
                raise
            st = Staging(self, mr, mp, size, sm)
            self.registrations += 1
        st.length = n
        return st

    def _give_back(self, st: Staging) -> None:
        if self._closed or self._cached + st.size_class > self._max:
            self._destroy(st)
            return
        self._cached += st.size_class
        self._free.setdefault(st.size_class, []).append(st)

    @staticmethod
    def _destroy(st: Staging) -> None:
        st.mr.close()
        if st.shared is not None:
            st.shared.close()
            return
        try:
            st.map.close()
        except BufferError:
            pass

    def close(self) -> None:
        self._closed = True
        for lst in self._free.values():
            for st in lst:
                self._destroy(st)
        self._free.clear()
        self._cached = 0
