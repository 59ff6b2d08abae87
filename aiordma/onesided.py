"""The one-sided operations of an ``Endpoint`` (``OneSided``): RDMA WRITE and READ,
WRITE with immediate (and receiving its immediate), and the two atomics, each queued as
operations (``protocol.engine.Op``) on the engine's send queues and awaited.

An operation larger than one work request may carry (the port's ``max_msg_sz``) is
posted as several (``Resources.wr_chunks``), in order on one queue; its last piece
carries the future. Cancelled before any piece was posted: nothing is sent; after:
every piece runs, and the buffers stay pinned until they complete.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from .errors import ConnectionClosed
from .memory import LocalSpan, RemoteBuffer
from .protocol.engine import IMM, READ, WRITE, Fifo, Op, atomic_op, rdma_op
from .protocol.state import Remote
from .verbs import SendWR, WROpcode
from .waiters import new_future

if TYPE_CHECKING:
    from .endpoint import Endpoint

_MASK64: Final = (1 << 64) - 1
# the opcodes, read once (a member read from its enum class goes through the enum's
# metaclass: hundreds of instructions per operation)
_RDMA_WRITE: Final = WROpcode.RDMA_WRITE
_RDMA_READ: Final = WROpcode.RDMA_READ
_RDMA_WRITE_WITH_IMM: Final = WROpcode.RDMA_WRITE_WITH_IMM
# (rdma_op's and atomic_op's opcodes: plain ints)
_WR_WRITE: Final = int(WROpcode.RDMA_WRITE)
_WR_READ: Final = int(WROpcode.RDMA_READ)
_WR_WRITE_WITH_IMM: Final = int(WROpcode.RDMA_WRITE_WITH_IMM)
_WR_FETCH_AND_ADD: Final = int(WROpcode.ATOMIC_FETCH_AND_ADD)
_WR_CMP_AND_SWP: Final = int(WROpcode.ATOMIC_CMP_AND_SWP)


class OneSided:
    """The one-sided operations of one endpoint, which exposes them (and documents
    them: ``Endpoint.write`` and the others). Uses the endpoint's engine, resources and
    checks; holds no state of its own."""

    def __init__(self, ep: Endpoint) -> None:
        self._ep = ep
        self._engine = ep._engine
        self._res = ep._res
        self._regions = ep._regions
        self._loop = ep._loop
        self._reactor = ep._reactor
        self._life = ep._life
        # the per-operation calls, bound once (not looked up by name each time)
        self._future_kw = ep._future_kw
        self._kick: Callable[[], None] = ep._engine.tx.kick
        self._oneq: Fifo[Op] = ep._engine.tx.oneq  # (the engine's, never replaced)

    def _new_future(self) -> asyncio.Future[Any]:
        """The future an operation's caller awaits (``waiters.new_future``)."""
        return new_future(self._loop, self._future_kw)

    async def write(self, local: Any, remote: RemoteBuffer) -> None:
        """RDMA WRITE all of ``local`` (a MemoryRegion or a buffer inside one registered
        with this endpoint) to the start of ``remote``.

        Raises ValueError (unregistered buffer, longer than ``remote``), TypeError,
        RemoteAccessError (peer refused: bad rkey, range, or right), ConnectionClosed.
        """
        span = self._one_sided_span(local, remote, writable=False)
        if span.length <= self._res.max_wr:  # one work request, built in the engine
            await self._submit(self._oneq, rdma_op(
                WRITE, self._new_future(), _WR_WRITE, span.addr, span.length, span.lkey,
                remote.addr, remote.rkey, 0, span))
            return
        wrs = self._res.wr_chunks(_RDMA_WRITE, span, span.length, remote.addr, remote.rkey)
        await self._submit_chunks(self._oneq, WRITE, wrs, span)

    async def read(self, local: Any, remote: RemoteBuffer) -> None:
        """RDMA READ ``len(local)`` bytes from the start of ``remote`` into ``local``.

        Raises as ``write``; ``local`` must be writable.
        """
        span = self._one_sided_span(local, remote, writable=True)
        if span.length <= self._res.max_wr:  # one work request, built in the engine
            await self._submit(self._oneq, rdma_op(
                READ, self._new_future(), _WR_READ, span.addr, span.length, span.lkey,
                remote.addr, remote.rkey, 0, span))
            return
        wrs = self._res.wr_chunks(_RDMA_READ, span, span.length, remote.addr, remote.rkey)
        await self._submit_chunks(self._oneq, READ, wrs, span)

    async def write_with_imm(self, local: Any, remote: RemoteBuffer, imm: int) -> None:
        """RDMA WRITE with a 32-bit immediate; the peer gets ``imm`` from ``recv_imm()``
        after the data is in place. Consumes one receive credit of the peer."""
        if not 0 <= imm < 1 << 32:
            raise ValueError("imm must be an unsigned 32-bit integer")
        span = self._one_sided_span(local, remote, writable=False)
        self._ep._snd.check()
        if span.length <= self._res.max_wr:  # one work request, built in the engine
            await self._submit(self._engine.tx.sendq, rdma_op(
                IMM, self._new_future(), _WR_WRITE_WITH_IMM, span.addr, span.length,
                span.lkey, remote.addr, remote.rkey, imm, span))
            return
        wrs = self._res.wr_chunks(_RDMA_WRITE, span, span.length, remote.addr, remote.rkey)
        last = wrs[-1]  # the immediate rides on the last piece, after the data is in place
        last.opcode = _RDMA_WRITE_WITH_IMM
        last.imm_data = imm
        # All pieces on the send queue, so no other work can pass between them.
        await self._submit_chunks(self._engine.tx.sendq, WRITE, wrs, span, last_kind=IMM)

    async def recv_imm(self) -> int:
        """The immediate of the next ``write_with_imm`` from the peer (in order).

        Raises ConnectionClosed like ``recv``.
        """
        rx = self._engine.rx
        while not rx.imm:
            if self._engine.state.failed or self._life.closing is not None:
                raise self._engine.closed_error()
            if self._engine.state.remote is not Remote.OPEN:
                raise ConnectionClosed("the peer closed the connection")
            await self._ep._rcv.wait_on(rx.imm_waiters)
        return rx.imm.popleft()

    async def fetch_add(self, remote: RemoteBuffer, value: int) -> int:
        """Atomically add ``value`` (mod 2**64) to the 8-byte word at ``remote``;
        returns the old value. ``remote.addr`` must be 8-byte aligned (ValueError)."""
        self._check_atomic(remote)
        op = atomic_op(self._new_future(), _WR_FETCH_AND_ADD, remote.addr, remote.rkey,
                       value & _MASK64)
        result: int = await self._submit(self._oneq, op)
        return result

    async def compare_swap(self, remote: RemoteBuffer, expected: int, new: int) -> int:
        """Atomically replace the 8-byte word at ``remote`` with ``new`` if it equals
        ``expected``; returns the old value (the swap happened iff it == expected)."""
        self._check_atomic(remote)
        op = atomic_op(self._new_future(), _WR_CMP_AND_SWP, remote.addr, remote.rkey,
                       expected & _MASK64, new & _MASK64)
        result: int = await self._submit(self._oneq, op)
        return result

    def _check_atomic(self, remote: RemoteBuffer) -> None:
        if not isinstance(remote, RemoteBuffer):
            raise TypeError("remote must be a RemoteBuffer")
        if remote.addr % 8:
            raise ValueError(f"atomic target {remote.addr:#x} is not 8-byte aligned")
        if remote.length < 8:
            raise ValueError("atomic target must span at least 8 bytes")
        self._ep._check_open()

    def _one_sided_span(self, local: Any, remote: RemoteBuffer, *, writable: bool) -> LocalSpan:
        if not isinstance(remote, RemoteBuffer):
            raise TypeError("remote must be a RemoteBuffer (from MemoryRegion.remote())")
        self._ep._check_open()
        span = self._regions.resolve(local, writable=writable)
        if span.length > remote.length:
            raise ValueError(f"local buffer of {span.length} bytes is larger than the remote "
                             f"range of {remote.length}")
        return span

    async def _submit(self, q: Fifo[Op], op: Op) -> Any:
        """Queue ``op`` on ``q``, post what resources allow, wait for its completion.

        Cancelled before it was posted: removed, never sent. Cancelled after: it runs
        to completion on the device and its buffers stay pinned until then.
        """
        q.append(op)
        self._kick()
        fut: asyncio.Future[Any] = op.fut  # type: ignore[assignment]
        try:
            if self._reactor.waits:
                return await self._reactor.wait(fut, op.posted)
            return await fut
        except asyncio.CancelledError:
            if not op.posted:
                self._engine.tx.unqueue(q, [op])
            raise

    async def _submit_chunks(self, q: Fifo[Op], kind: int, wrs: list[SendWR],
                             span: LocalSpan, *, last_kind: int | None = None) -> None:
        """``_submit`` for an operation posted as several work requests (``wr_chunks``),
        in order on ``q``: the last one (of ``last_kind``, default ``kind``) carries the
        future; the completions of one QP arrive in order, so it completes after the
        others. A failed piece fails the endpoint, and the last piece then reports it.
        Cancelled before any piece was posted: none is sent; after: all run."""
        final_kind = kind if last_kind is None else last_kind
        if len(wrs) == 1:
            await self._submit(q, Op(final_kind, self._new_future(), wr=wrs[0], keep=span))
            return
        ops = [Op(kind, None, wr=wr, keep=span) for wr in wrs[:-1]]
        q.extend(ops)
        last = Op(final_kind, self._new_future(), wr=wrs[-1], keep=span)
        ops.append(last)
        tx = self._engine.tx
        try:
            await self._submit(q, last)
        except asyncio.CancelledError:
            if not any(op.posted for op in ops):
                tx.unqueue(q, ops)
            elif not last.posted:  # the rest must go, or the operation would be partial
                q.append(last)
                tx.kick()
            raise
