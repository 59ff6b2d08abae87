"""An endpoint's life after the handshake: the watch on the setup connection, graceful
close, half-close, abort, and the teardown order.

* The setup TCP connection stays open for the endpoint's life: its EOF means the peer
  is gone (killed, aborted) even when no work request is outstanding. After the
  peer's CLOSE it is like TCP's CLOSE_WAIT: what was received stays readable, nothing
  can be sent; posted sends the peer never acknowledged fail after a grace period.
* ``close()``: pending sends complete (at most ``close_timeout``), then our CLOSE, then
  the teardown. ``send_eof()``: our CLOSE once every message already passed to
  ``send`` is delivered, nothing torn down. ``abort()``: everything fails now.
* Teardown, in the order that cannot hang: QP to ERR (the failure path), wait for
  every flush (``drained``), then destroy the QP, MRs, CQ reservation and PD, release
  the device (``Resources.destroy``). A cancelled teardown destroys at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final, cast

from . import liveness
from .errors import ConnectionClosed, PeerUnresponsive, RDMAError
from .protocol.engine import DATA, IMM, RNDV, MessageEngine, wake
from .protocol.errors import RemoteProtocolError
from .protocol.state import Local, Remote
from .resources import Resources

log = logging.getLogger("aiordma")

GRACE_S: Final = 1.0  # after the peer's EOF, how long posted work may take to complete


async def uncancelled(fut: asyncio.Future[Any], timeout: float | None = None) -> Any:
    """Wait for ``fut`` without ever cancelling it (unlike ``asyncio.shield``, a failure
    after our caller was cancelled is not reported to the loop's exception handler).

    Returns its result or raises its exception; TimeoutError after ``timeout``.
    """
    if not fut.done():
        if timeout is not None:
            await asyncio.wait((fut,), timeout=timeout)
            if not fut.done():
                raise TimeoutError(f"not done after {timeout:g}s")
        else:  # asyncio.wait without its sets and timer (the rendezvous receive path)
            waiter = fut.get_loop().create_future()

            def wake_up(_f: asyncio.Future[Any]) -> None:
                if not waiter.done():
                    waiter.set_result(None)

            fut.add_done_callback(wake_up)
            try:
                await waiter
            finally:
                fut.remove_done_callback(wake_up)
    return fut.result()


class Lifecycle:
    """The lifecycle of one endpoint (module doc); also the engine's lifecycle hooks
    (``on_failed``, ``check_drained``, ``maybe_closed``), through ``Resources``."""

    def __init__(self, ep: object, loop: asyncio.AbstractEventLoop, engine: MessageEngine,
                 res: Resources, close_timeout: float) -> None:
        """``ep``: the endpoint (named in logs; the owner of its completion handlers)."""
        self._ep = ep
        self._loop = loop
        self._engine = engine
        self._res = res
        self._close_timeout = close_timeout
        self.closing: asyncio.Future[None] | None = None  # close() or abort() was called
        self.eof: asyncio.Future[None] | None = None  # our CLOSE frame (send_eof/close)
        self.drained = loop.create_future()
        self.done = loop.create_future()
        self._teardown_task: asyncio.Task[None] | None = None
        self.control: asyncio.StreamWriter | None = None
        self.heartbeat: liveness.Heartbeat | None = None
        self._watch_task: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- engine hooks
    def on_failed(self, exc: BaseException, unexpected: bool) -> None:
        if unexpected:
            log.warning("aiordma: %r failed: %s", self._ep, exc)
        self.wake_closer()
        if self.control is not None:
            self.control.close()
        self._start_teardown()
        self.check_drained()

    def check_drained(self) -> None:
        # (unsignaled WRs after the last signaled one may never complete: the QP is
        # destroyed before their buffers are freed, see destroy_now)
        e = self._engine
        if (e.state.failed and not e.tx.sq.awaited and not e.rx.posted
                and not self.drained.done()):
            self.drained.set_result(None)

    def maybe_closed(self) -> None:
        if self.closing is not None and not self._engine.ops_pending():
            self.wake_closer()

    def wake_closer(self) -> None:
        if self.closing is not None and not self.closing.done():
            self.closing.set_result(None)

    # ---------------------------------------------------------------- the setup connection
    def start(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
              heartbeat: liveness.Heartbeat | None) -> None:
        """Begin watching the out-of-band TCP connection: its EOF means the peer is gone,
        ``heartbeat`` (``liveness``) finds a peer frozen or cut off."""
        self.control = writer
        self.heartbeat = heartbeat
        self._watch_task = self._loop.create_task(self._watch_control(reader, writer,
                                                                      heartbeat))

    async def _watch_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             hb: liveness.Heartbeat | None) -> None:
        try:
            await liveness.watch(reader, writer, hb)
        except (PeerUnresponsive, RemoteProtocolError) as exc:
            self._engine.fail(exc)
            return
        except asyncio.CancelledError:
            return
        e = self._engine
        if e.state.failed or self.done.done():
            return
        # The peer's CLOSE frame, if it sent one, is in our CQ by now (its SEND was
        # acknowledged before it dropped the connection): collect it first.
        self._res.reactor.drain_cq(self._res.cq)
        if e.state.remote is Remote.OPEN:
            # Give posted work a moment, so that callers see the precise error.
            await self._grace_for_posted()
            e.fail(ConnectionClosed("peer closed the connection"))
            return
        # Like TCP's CLOSE_WAIT: the application still reads what was sent before the
        # peer's CLOSE, then closes us. Nothing can reach the peer any more.
        self._peer_gone()
        # Sends posted before we knew that end with their completion if the peer
        # acknowledged them in time. The rest never reached its application: rxe may
        # retransmit them into the void for longer than any close waits (seen: over
        # 20 s), so after the grace period their senders get ConnectionClosed (their
        # buffers stay pinned until the teardown).
        await self._grace_for_posted()
        e.fail_unacknowledged()

    def _peer_gone(self) -> None:
        e = self._engine
        e.peer_gone()
        eof = self.eof
        if eof is not None and e.state.local is Local.CLOSE_SENT and not eof.done():
            # Our CLOSE is posted but the peer's QP is gone: no ACK will come (rxe
            # retransmits into the void), so neither close() nor send_eof() waits for it.
            eof.set_exception(ConnectionClosed("the peer closed the connection"))
        if self.closing is not None:
            self.wake_closer()  # for the same reason, posted sends will not complete

    async def _grace_for_posted(self) -> None:
        """Wait up to ``GRACE_S`` (the peer's QP is in ERR or gone) for posted work that
        somebody awaits to end with its own completion; returns early on a failure."""
        e = self._engine
        deadline = self._loop.time() + GRACE_S
        while e.tx.sq.awaited and not e.state.failed and self._loop.time() < deadline:
            await asyncio.sleep(0.005)

    # ---------------------------------------------------------------- close, eof, abort
    async def close(self) -> None:
        """``Endpoint.close`` (its docstring is the contract)."""
        e = self._engine
        if self.closing is None and not e.state.failed:
            self.closing = self._loop.create_future()
            e.close_watch = True  # (the engine tells us when its work finishes)
            e.shut_wr()
            if not e.ops_pending():
                self.closing.set_result(None)
            try:
                await uncancelled(self.closing, self._close_timeout)
                if (not e.state.failed and e.credits is not None
                        and e.state.remote is not Remote.GONE):
                    self._queue_eof(final=True)
                    assert self.eof is not None
                    await uncancelled(self.eof, self._close_timeout)
            except (TimeoutError, RDMAError):
                pass
            except asyncio.CancelledError:
                # Nobody waits any more (e.g. asyncio.run() cancelling what is left at
                # exit): abort and destroy now, so nothing is left for the GC to destroy
                # (with unacknowledged events, ibv_destroy_cq would block the exit).
                self.abort()
                self.destroy_now()
                raise
            wake(e.rx.rx_waiters)
            wake(e.rx.imm_waiters)
            e.fail(ConnectionClosed("endpoint is closed"))
        self._start_teardown()
        try:
            await uncancelled(self.done)
        except asyncio.CancelledError:
            self.destroy_now()  # as above: do not leave it to a task that may never run
            raise

    async def send_eof(self) -> None:
        """``Endpoint.send_eof`` (its docstring is the contract)."""
        e = self._engine
        if self.eof is None:
            e.shut_wr()
            pending = [cast("asyncio.Future[Any]", op.fut)
                       for op in (*e.tx.sendq, *e.tx.posted_ops(), *e.tx.rndv_out.values())
                       if op.kind in (DATA, RNDV, IMM) and op.fut is not None
                       and not op.fut.done()]
            self._new_eof()
            left = len(pending)

            def sent(_f: asyncio.Future[Any]) -> None:
                nonlocal left
                left -= 1
                if not left:
                    self._queue_eof(final=False)

            for f in pending:
                f.add_done_callback(sent)
            if not pending:
                self._queue_eof(final=False)
        assert self.eof is not None
        await uncancelled(self.eof)

    def _new_eof(self) -> asyncio.Future[None]:
        if self.eof is None:
            self.eof = self._loop.create_future()
            # Nobody may wait for it (a cancelled send_eof): never warn "never retrieved".
            self.eof.add_done_callback(lambda f: f.cancelled() or f.exception())
        return self.eof

    def _queue_eof(self, *, final: bool) -> None:
        """Queue our CLOSE frame once (it completes ``eof``); after a failure, fail
        ``eof`` instead."""
        eof = self._new_eof()
        if eof.done():
            return
        self._engine.queue_close(eof, final=final)

    def abort(self, now: bool = False) -> None:
        """``Endpoint.abort``. ``now``: also destroy every resource before returning (for a
        caller being cancelled, e.g. by asyncio.run() at exit, which would otherwise leave
        the teardown to a task that never runs)."""
        if self.closing is None:
            self.closing = self._loop.create_future()
            self.closing.set_result(None)
            self._engine.close_watch = True
        self._engine.fail(ConnectionClosed("endpoint was aborted"))
        if now:
            self.destroy_now()

    # ---------------------------------------------------------------- teardown
    def _start_teardown(self) -> None:
        if self._teardown_task is None:
            self._teardown_task = self._loop.create_task(self._teardown())

    async def _teardown(self) -> None:
        """Destroy in the order that cannot hang: QP to ERR, wait for every flush, then
        destroy QP, MRs, CQ reservation, PD; release the device. Cancelled (the loop is
        shutting down), it destroys at once without waiting for the flush."""
        try:
            if not self._engine.state.failed:
                self._engine.fail(ConnectionClosed("endpoint is closed"))
            try:
                await uncancelled(self.drained, self._close_timeout)
            except TimeoutError:
                log.warning("aiordma: %r: flush did not complete in %.1fs; destroying anyway",
                            self._ep, self._close_timeout)
        finally:
            self.destroy_now()

    def destroy_now(self) -> None:
        """Destroy every resource now (idempotent; sync, so it also runs from a cancelled
        task or close()). Safe without the flush: once the QP is destroyed the device no
        longer touches our buffers, and the reactor drops completions of unknown wr_ids."""
        if self.done.done():
            return
        task = self._teardown_task
        # (no running loop: the task's coroutine is being closed by the GC)
        running = asyncio.current_task() if self._loop.is_running() else None
        if task is not None and not task.done() and task is not running:
            task.cancel()  # it only waits for the flush; its finally finds us done
        try:
            if self._watch_task is not None and not self._watch_task.done():
                self._watch_task.cancel()
            self._engine.drain_for_teardown()
            rx = self._engine.rx
            if rx.posted:  # not flushed: their completions must find no handler
                self._res.reactor.unregister_owner(rx)
                rx.posted = 0
            self._res.destroy()
        finally:
            self.done.set_result(None)
