"""``RDMAComm``, its connector and its listener: Dask comms over aiordma endpoints.

One comm is one ``aiordma.Endpoint``. ``write`` serializes with Dask's ``to_frames``
and sends the frames as ``frames.py`` lays them out: small frames copied into one head
message, large ones separately. ``read`` receives the head, then each separate frame
into a buffer allocated for it (``host_array``, as Dask's TCP comm does): a frame of at
least ``REGISTER_MIN`` bytes is registered with the endpoint first, so the rendezvous
READ lands straight in it (no copy); on the sending side a writable frame of that size
(numpy arrays and other buffer-protocol objects) is registered for remote read, so the
peer READs it from where it lies. Read-only frames (``bytes``) are copied once into the
endpoint's staging. Regions are deregistered as soon as their transfer is done.

Semantics are those of ``distributed.comm.core.Comm``: one reader and one writer at a
time; ``CommClosedError`` once the peer closed or went away (after everything it sent
before is read), after ``close()``/``abort()``, and for a read or write that fails
midway (the comm is aborted: what was already on the wire is unknown). ``close()``
lets pending writes finish, then the peer's reads raise ``CommClosedError``;
``abort()`` fails everything at once. A comm dropped without either is aborted when it
is garbage collected.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import weakref
from collections.abc import Coroutine
from typing import Any, ClassVar, Final

import dask
from distributed.comm.addressing import parse_host_port, unparse_host_port
from distributed.comm.core import BaseListener, Comm, CommClosedError, Connector
from distributed.comm.core import FatalCommClosedError as _Fatal
from distributed.comm.tcp import RequireEncryptionMixin
from distributed.comm.utils import ensure_concrete_host, from_frames, to_frames
from distributed.protocol.utils import host_array
from distributed.utils import nbytes

import aiordma

from . import frames as fr
from .regions import SendRegions

logger = logging.getLogger("aiordma.dask")

#: frames of at least this many bytes are registered for a zero-copy transfer
REGISTER_MIN: Final = 256 * fr.KiB
#: endpoint options of every Dask comm; ``distributed.comm.rdma`` in Dask's config
#: overrides them (any ``aiordma.connect`` option, e.g. ``{"provider": "soft"}``)
DEFAULT_OPTIONS: Final[dict[str, Any]] = {
    # READ each large frame only once its own buffer waits for it (never into staging)
    "rndv_prefetch": 0,
    # the largest piece of a frame, plus the head of a message of many frames
    "max_message_size": 2 * fr.PIECE,
}
PREFIX: Final = "rdma://"


def endpoint_options() -> dict[str, Any]:
    """The ``aiordma.connect``/``listen`` options of a new comm: ``DEFAULT_OPTIONS``
    updated with Dask's ``distributed.comm.rdma`` setting. Raises TypeError when that
    setting is not a mapping."""
    extra = dask.config.get("distributed.comm.rdma", default=None) or {}
    if not isinstance(extra, dict):
        raise TypeError(f"dask config distributed.comm.rdma must be a mapping of aiordma "
                        f"options, not {type(extra).__name__}")
    return {**DEFAULT_OPTIONS, **extra}


def _address(sockaddr: Any) -> str:
    """``rdma://host:port`` of a socket address tuple."""
    return PREFIX + unparse_host_port(sockaddr[0], sockaddr[1])


def _start(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
    """A task running ``coro``; its first step (where ``Endpoint.send`` queues the
    message) runs now where asyncio can (3.12+: eager tasks), else in the loop's next
    iteration, in the order the tasks were made."""
    if _eager is not None:
        task: asyncio.Future[None] = _eager(loop, coro)
        return task
    return loop.create_task(coro)


_eager = getattr(asyncio, "eager_task_factory", None)


def _abort_dangling(ep: aiordma.Endpoint, loop: asyncio.AbstractEventLoop, name: str) -> None:
    """Finalizer of a comm collected while open: abort its endpoint on its loop."""
    if ep.closed:
        return
    logger.warning("aiordma.dask: closing dangling comm %s", name)
    try:
        loop.call_soon_threadsafe(ep.abort)
    except RuntimeError:  # the loop is closed: nothing runs the endpoint any more
        pass


class RDMAComm(Comm):
    """A Dask comm over one aiordma endpoint (see the module docstring)."""

    max_shard_size: ClassVar[int] = dask.utils.parse_bytes(
        dask.config.get("distributed.comm.shard"))

    def __init__(self, ep: aiordma.Endpoint, local_addr: str, peer_addr: str,
                 deserialize: bool = True) -> None:
        super().__init__(deserialize=deserialize)
        self._ep: aiordma.Endpoint | None = ep
        self._local_addr = local_addr
        self._peer_addr = peer_addr
        self._closed = False
        self._sending: set[asyncio.Future[Any]] = set()  # writes not yet delivered
        self._tx = SendRegions(ep)
        self._extra = {"provider": ep.provider, "device": ep.device_name}
        self._finalizer = weakref.finalize(self, _abort_dangling, ep,
                                           asyncio.get_running_loop(), repr(self))
        self._finalizer.atexit = False

    @property
    def local_address(self) -> str:
        return self._local_addr

    @property
    def peer_address(self) -> str:
        return self._peer_addr

    @property
    def extra_info(self) -> dict[str, Any]:
        return self._extra

    @property
    def endpoint(self) -> aiordma.Endpoint | None:
        """The endpoint under the comm (None once it is closed)."""
        return self._ep

    def _open_endpoint(self) -> aiordma.Endpoint:
        ep = self._ep
        if ep is None or self._closed:
            raise CommClosedError(f"{self!r}: comm is closed")
        return ep

    def _lost(self, exc: BaseException) -> CommClosedError:
        """The peer went away or the endpoint failed: the comm is closed."""
        self.abort()
        err = CommClosedError(f"in {self!r}: {exc}")
        err.__cause__ = exc
        return err

    async def read(self, deserializers: Any = None) -> Any:
        """The next Dask message. Raises CommClosedError (see the module docstring)."""
        ep = self._open_endpoint()
        try:
            head = memoryview(bytearray(await ep.recv()))
            frames: list[Any] = []
            for item in fr.parse(head):
                if isinstance(item, int):
                    frames.append(await self._recv_frame(ep, item))
                else:
                    frames.append(item)
        except aiordma.ConnectionClosed as exc:
            raise self._lost(exc) from exc
        except fr.FramingError as exc:
            raise self._lost(exc) from exc
        except BaseException:
            # cancelled or failed midway: what is left of the message is unknown
            self.abort()
            raise
        try:
            return await from_frames(frames, deserialize=self.deserialize,
                                     deserializers=deserializers,
                                     allow_offload=self.allow_offload)
        except EOFError:
            self.abort()
            raise CommClosedError("aborted stream on truncated data") from None

    async def _recv_frame(self, ep: aiordma.Endpoint, length: int) -> memoryview:
        """A separate frame of ``length`` bytes, into a buffer of its own."""
        buf = host_array(length)
        region = ep.register(buf) if length >= REGISTER_MIN else None
        try:
            for off, n in fr.pieces(length):
                got = await ep.recv_into(buf[off: off + n])
                if got != n:
                    raise fr.FramingError(f"frame piece of {got} bytes, expected {n}")
        except aiordma.MessageTooLarge as exc:
            raise fr.FramingError(f"frame piece larger than announced: {exc}") from exc
        finally:
            if region is not None:
                region.close()
        return buf

    async def write(self, msg: Any, serializers: Any = None,
                    on_error: str | None = "message") -> int:
        """Send one Dask message; returns its frames' total size.

        Returns once the message is handed to the endpoint, not when the peer has read
        it (as Dask's TCP comm returns once its stream buffered it): a large frame
        waits at the sender, pinned, until the peer READs it, so a writer never waits
        for its peer to read. The frames must not change until then (Dask's never do).
        A send that fails later aborts the comm: the next read or write raises
        CommClosedError. Raises CommClosedError (see the module docstring).
        """
        ep = self._open_endpoint()
        frames = await to_frames(
            msg, allow_offload=self.allow_offload, serializers=serializers,
            on_error=on_error,
            context={"sender": self.local_info, "recipient": self.remote_info,
                     **self.handshake_options},
            frame_split_size=self.max_shard_size)
        ep = self._open_endpoint()  # (serializing may have taken a while)
        head, separate = fr.plan(frames, ep.eager_payload)
        try:
            self._start_sends(ep, head, separate)
        except aiordma.ConnectionClosed as exc:
            raise self._lost(exc) from exc
        except BaseException:
            self.abort()
            raise
        return sum(map(nbytes, frames))

    def _start_sends(self, ep: aiordma.Endpoint, head: bytearray,
                     separate: list[memoryview]) -> None:
        """Queue the head and the separate frames on the endpoint, in order (each send
        task queues its message in its first step, and tasks start in the order they
        were made); large writable frames are sent from registered regions
        (``regions.py``), so the peer READs them from where they lie."""
        regions = self._tx.hold([mv for mv in separate
                                 if mv.nbytes >= REGISTER_MIN and not mv.readonly])
        loop = asyncio.get_running_loop()
        sends = [_start(loop, ep.send(head))]
        for mv in separate:
            sends += [_start(loop, ep.send(mv[off: off + n])) for off, n in fr.pieces(mv.nbytes)]
        done = sends[0] if len(sends) == 1 else asyncio.gather(*sends)
        self._sending.add(done)
        done.add_done_callback(functools.partial(self._sent, regions))

    def _sent(self, regions: list[aiordma.MemoryRegion], done: asyncio.Future[Any]) -> None:
        self._sending.discard(done)
        failed = not done.cancelled() and done.exception() is not None
        if failed or done.cancelled():
            logger.debug("aiordma.dask: a write of %r failed: %r", self,
                         None if done.cancelled() else done.exception())
            self.abort()  # (before the regions go: sends still posted fail, not fault)
        self._tx.release(regions)

    async def close(self) -> None:
        """Close gracefully: pending writes finish, then the peer sees the comm closed.
        Idempotent."""
        ep, self._ep = self._ep, None
        self._closed = True
        if ep is not None:
            self._finalizer.detach()
            if self._sending:
                # the send tasks of the last writes queue their messages in their first
                # step, which runs in the loop's next iteration: let them, so that the
                # endpoint's close delivers them before its EOF
                await asyncio.sleep(0)
            try:
                await ep.close()
            except (aiordma.RDMAError, OSError):
                pass

    def abort(self) -> None:
        """Close at once: pending reads and writes fail. Idempotent."""
        ep, self._ep = self._ep, None
        self._closed = True
        if ep is not None:
            self._finalizer.detach()
            ep.abort()

    def closed(self) -> bool:
        return self._closed or self._ep is None or self._ep.closed


class RDMAConnector(Connector, RequireEncryptionMixin):
    """Connects to ``rdma://host:port`` listeners (other connection arguments, such as
    TLS contexts from Dask's security settings, are ignored: RDMA traffic is not
    encrypted, so ``require_encryption`` refuses the scheme)."""

    prefix: ClassVar[str] = PREFIX
    comm_class: ClassVar[type[RDMAComm]] = RDMAComm
    encrypted: ClassVar[bool] = False

    async def connect(self, address: str, deserialize: bool = True,
                      **connection_args: Any) -> RDMAComm:
        """An established comm to ``address`` (``host:port``). Raises CommClosedError
        when nothing listens there or the setup fails (Dask's ``connect`` retries until
        its timeout), FatalCommClosedError when the shared secret is refused,
        ValueError for a malformed address."""
        self._check_encryption(address, connection_args)
        host, port = parse_host_port(address)
        try:
            ep = await aiordma.connect(host, port, **endpoint_options())
        except aiordma.AuthenticationError as exc:
            raise _Fatal(f"in {self.prefix}{address}: {exc}") from exc
        except OSError as exc:  # refused, handshake, resources, timeouts (RDMAError too)
            raise CommClosedError(f"in {self.prefix}{address}: {exc}") from exc
        assert ep.local_address is not None
        return self.comm_class(ep, _address(ep.local_address), self.prefix + address,
                               deserialize)


class RDMAListener(BaseListener, RequireEncryptionMixin):
    """Listens on ``rdma://host:port`` (empty host: every interface; port 0: any);
    ``comm_handler(comm)`` runs for each comm once Dask's handshake is done."""

    prefix: ClassVar[str] = PREFIX
    comm_class: ClassVar[type[RDMAComm]] = RDMAComm
    encrypted: ClassVar[bool] = False

    def __init__(self, address: str, comm_handler: Any, deserialize: bool = True,
                 allow_offload: bool = True, default_host: str | None = None,
                 default_port: int = 0, **connection_args: Any) -> None:
        super().__init__()
        self._check_encryption(address, connection_args)
        self.ip, self.port = parse_host_port(address, default_port)
        self.default_host = default_host
        self.comm_handler = comm_handler
        self.deserialize = deserialize
        self.allow_offload = allow_offload
        self._listener: aiordma.Listener | None = None
        self._bound: tuple[str, int] | None = None

    async def start(self) -> None:
        """Bind and start accepting. Raises OSError (address in use, ...)."""
        self._listener = await aiordma.listen(self._serve, self.ip or None, self.port,
                                              **endpoint_options())
        socks = self._listener.sockets
        # (listening on every interface: prefer IPv4, as Dask's TCP listener does)
        sock = next((s for s in socks if s.family == socket.AF_INET), socks[0])
        self._bound = sock.getsockname()[:2]

    def stop(self) -> None:
        """Stop accepting; established comms (and those in Dask's handshake) live on."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    async def _serve(self, ep: aiordma.Endpoint) -> None:
        """The aiordma handler of one connection: Dask's handshake, then the comm
        handler; the endpoint lives until the comm is closed (aiordma would close it
        when this returns)."""
        assert ep.local_address is not None and ep.peer_address is not None
        comm: RDMAComm | None = self.comm_class(
            ep, _address(ep.local_address), _address(ep.peer_address), self.deserialize)
        assert comm is not None
        comm.allow_offload = self.allow_offload
        if self._listener is None:
            # stopped after aiordma accepted it: close it, or the client would wait for
            # Dask's handshake forever (it has no timeout)
            comm.abort()
            return
        try:
            await self.on_connection(comm)
        except CommClosedError:
            logger.info("connection from %s closed before handshake completed",
                        comm.peer_address)
            return
        await self.comm_handler(comm)
        comm = None  # the comm may be collected now (its finalizer aborts the endpoint)
        await ep.wait_closed()

    def get_host_port(self) -> tuple[str, int]:
        """The bound ``(host, port)``. Raises ValueError before ``start()``."""
        if self._bound is None:
            raise ValueError("invalid operation on non-started RDMAListener")
        return self._bound

    @property
    def listen_address(self) -> str:
        return self.prefix + unparse_host_port(*self.get_host_port())

    @property
    def contact_address(self) -> str:
        host, port = self.get_host_port()
        host = ensure_concrete_host(host, default_host=self.default_host)
        return self.prefix + unparse_host_port(host, port)
