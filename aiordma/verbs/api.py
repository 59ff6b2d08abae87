"""The provider interface: the verbs object model every provider implements.

Everything above ``aiordma/verbs/`` programs against these abstract classes only. A
provider (``soft``, ``verbs``) subclasses them. Contracts common to all providers:

* Objects are closed with ``close()``; closing twice is a no-op. Closing a parent with
  live children is refused with ``RDMAError`` (EBUSY), as ibv_dealloc_pd etc. do.
* ``QP.post_send``/``post_recv`` take a *list* (the chain). A chain is checked whole
  before anything is posted: on refusal nothing of it is posted and ``PostError`` is
  raised (EINVAL: QP state or bad WR; ENOMEM: queue full). Completions of one QP's send
  queue arrive in posting order; so do those of its receive queue.
* Unsignaled send WRs produce no completion on success, and their send-queue slots are
  released only when a later signaled WR of the same QP completes and is polled (as on
  hardware). An unsignaled WR that fails does produce an error completion.
* ``CQ.poll(n)`` returns up to ``n`` completions and never blocks; after an overrun it
  raises ``CQOverrunError`` forever.
* Completion channel: ``CQ.req_notify()`` arms once; one event is queued on the
  channel for the first completion added *after* arming, then the CQ is disarmed.
  ``CompChannel.fd`` is a non-blocking file descriptor that is readable while events are
  queued; ``get_event()`` returns the CQ of the next event or ``None`` (EAGAIN). Every
  event must be acknowledged with ``CQ.ack_events(n)`` before the CQ is closed.
* Methods are called from one thread (the event loop's); providers may run their own
  threads internally.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any

from .enums import MTU, Access, EventType, LinkLayer, PortState, QPState
from .wr import WC, RecvWR, SendWR


@dataclasses.dataclass(frozen=True)
class PortInfo:
    """What ``list_devices()`` reports of one port."""

    port_num: int
    state: PortState
    link_layer: LinkLayer
    active_mtu: MTU
    lid: int = 0


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """One device as listed by ``aiordma.list_devices()``."""

    name: str
    provider: str
    ports: tuple[PortInfo, ...]

    @property
    def active(self) -> bool:
        """True when at least one port is ACTIVE."""
        return any(p.state == PortState.ACTIVE for p in self.ports)


@dataclasses.dataclass(frozen=True)
class DeviceAttr:
    """The subset of ibv_device_attr aiordma uses."""

    max_qp_wr: int
    max_sge: int
    max_cqe: int
    max_mr_size: int
    max_qp_rd_atom: int
    max_qp_init_rd_atom: int
    max_inline_data: int = 0
    atomic_cap: int = 1  # 0 = none, 1 = HCA-atomic, 2 = global
    vendor: str = ""
    fw_ver: str = ""


@dataclasses.dataclass(frozen=True)
class PortAttr:
    """The subset of ibv_port_attr aiordma uses."""

    state: PortState
    active_mtu: MTU
    max_mtu: MTU
    lid: int
    gid_tbl_len: int
    link_layer: LinkLayer
    max_msg_sz: int


@dataclasses.dataclass
class AHAttr:
    """Address of the remote port (ibv_ah_attr subset).

    RoCE: ``is_global`` with ``dgid`` (16 bytes) and ``sgid_index``; InfiniBand: ``dlid``.
    The ``soft`` provider uses ``dgid`` (IPv4-mapped address of the peer device) and
    ``dlid`` (the peer device's TCP port).
    """

    dgid: bytes = b"\0" * 16
    dlid: int = 0
    sgid_index: int = 0
    is_global: bool = True
    hop_limit: int = 64
    port_num: int = 1
    sl: int = 0


@dataclasses.dataclass
class QPCap:
    """Queue sizes of a QP (ibv_qp_cap)."""

    max_send_wr: int = 128
    max_recv_wr: int = 128
    max_send_sge: int = 1
    max_recv_sge: int = 1
    max_inline_data: int = 0


@dataclasses.dataclass
class QPAttr:
    """Attributes for ``QP.modify`` (ibv_qp_attr subset); ``qp_state`` is the target.

    Required per transition (as rdma-core): RESET->INIT: port_num, pkey_index,
    qp_access_flags. INIT->RTR: path_mtu, dest_qp_num, rq_psn, max_dest_rd_atomic,
    min_rnr_timer, ah_attr. RTR->RTS: sq_psn, timeout, retry_cnt, rnr_retry,
    max_rd_atomic. Any->ERR / RESET: nothing.

    ``auth_key`` (RESET->INIT; the ``soft`` provider only, hardware has no such check):
    a secret of at least 16 bytes that both QPs of a connection are given; the soft
    device admits a connection to this QP only from a device that proves it knows the
    key (its HELLO's MAC). ``None``: the device's own secret, so only QPs of the same
    process can connect.
    """

    qp_state: QPState
    port_num: int = 1
    pkey_index: int = 0
    qp_access_flags: Access = Access(0)
    path_mtu: MTU = MTU.MTU_1024
    dest_qp_num: int = 0
    rq_psn: int = 0
    sq_psn: int = 0
    max_dest_rd_atomic: int = 1
    max_rd_atomic: int = 1
    min_rnr_timer: int = 12
    timeout: int = 14
    retry_cnt: int = 7
    rnr_retry: int = 7
    ah_attr: AHAttr | None = None
    auth_key: bytes | None = None


@dataclasses.dataclass(frozen=True)
class AsyncEvent:
    """A device async event (already acknowledged by the provider).

    ``qp_num`` is set for QP events, ``port_num`` for port events, ``cq`` for CQ_ERR.
    """

    event_type: EventType
    qp_num: int | None = None
    port_num: int | None = None
    cq: CQ | None = None


class MR(abc.ABC):
    """A registered memory region. ``view`` is a byte memoryview of the whole region."""

    addr: int
    length: int
    lkey: int
    rkey: int
    access: Access
    view: memoryview
    pd: PD

    @abc.abstractmethod
    def close(self) -> None:
        """Deregister; remote access with its rkey fails from now on. Idempotent."""


class CompChannel(abc.ABC):
    """A completion event channel with a pollable, non-blocking ``fd``.

    *Manual progress* (``manual_progress`` True: the ``soft`` device): the provider
    moves its bytes in the thread that consumes the channel. That thread calls
    ``start_progress()`` once and then ``progress()`` whenever the fd it returned is
    readable (and before it waits for a completion); without that the device's own
    thread moves them, later. Devices that progress by themselves (RDMA hardware) have
    ``manual_progress`` False and need neither call.

    A manual-progress device may defer work that ``progress()`` produced (``soft``: the
    acknowledgements of what it delivered, so that they ride on the application's
    answer): ``flush_wanted`` is then True until the consumer calls ``flush()``, which
    it does once the callbacks of that progress have run.
    """

    fd: int
    #: True where the consumer moves the device's bytes (``start_progress``/``progress``)
    manual_progress: bool = False

    def start_progress(self) -> int:
        """Switch to manual progress driven by the calling thread; returns the fd that is
        readable when ``progress()`` has work. Only where ``manual_progress``."""
        raise NotImplementedError("this channel's device progresses by itself")

    def progress(self, quiet: bool = False) -> int:
        """Move the device's bytes (manual progress); returns how many sockets were
        ready. Never blocks. Only where ``manual_progress``."""
        raise NotImplementedError("this channel's device progresses by itself")

    @property
    def flush_wanted(self) -> bool:
        """True while ``progress()`` left deferred work for ``flush()`` (never, unless
        the device defers work)."""
        return False

    def flush(self) -> None:
        """Do the work ``progress()`` deferred. Never blocks; a no-op when
        ``flush_wanted`` is False."""
        return None

    @abc.abstractmethod
    def get_event(self) -> CQ | None:
        """The CQ of the next queued event, or ``None`` if none is queued. Never blocks."""

    def event_reader(self) -> Callable[[], CQ | None]:
        """``get_event`` as the callable a consumer calls for every event: compiled
        where the provider has it so (the same contract); by default the bound
        method."""
        return self.get_event

    @abc.abstractmethod
    def close(self) -> None:
        """Destroy; refused (RDMAError EBUSY) while CQs use it. Idempotent."""


class CQ(abc.ABC):
    """A completion queue of capacity ``cqe``, optionally bound to a channel."""

    cqe: int
    channel: CompChannel | None

    @abc.abstractmethod
    def poll(self, n: int = 16) -> list[WC]:
        """Up to ``n`` completions, oldest first; ``[]`` when empty. Raises CQOverrunError."""

    def c_ops(self) -> Any:
        """The CQ's C-level poll, for compiled callers: ``(capsule, target)``, the
        PyCapsule named ``CCQ_OPS`` (``verbs/cverbs.pxd``) and the object to pass as
        its first argument; None where the provider has none (the default)."""
        return None

    @abc.abstractmethod
    def req_notify(self, solicited_only: bool = False) -> None:
        """Arm: one channel event for the next completion added after this call."""

    def notifier(self) -> Callable[[], None]:
        """``req_notify()`` (every completion, not solicited-only) as the callable a
        consumer calls to arm after every event: compiled where the provider has it so
        (the same contract); by default the bound method."""
        return self.req_notify

    @abc.abstractmethod
    def ack_events(self, n: int) -> None:
        """Acknowledge ``n`` events obtained from the channel for this CQ."""

    @abc.abstractmethod
    def close(self) -> None:
        """Destroy; refused (EBUSY) while QPs use it or events are unacknowledged."""


class QP(abc.ABC):
    """A reliable-connected queue pair."""

    qp_num: int
    cap: QPCap
    pd: PD
    send_cq: CQ
    recv_cq: CQ

    @property
    @abc.abstractmethod
    def state(self) -> QPState:
        """The current state (ERR after an error completion or ``modify`` to ERR)."""

    @property
    def modify_releases_gil(self) -> bool:
        """True when ``modify`` to RTR releases the GIL while it waits: on RoCE the
        kernel resolves the destination GID's address there (up to seconds when the
        peer does not answer), so a caller on an event loop may run it in a thread.
        False (the default): it is quick, or holds the GIL anyway."""
        return False

    @abc.abstractmethod
    def modify(self, attr: QPAttr) -> None:
        """Transition to ``attr.qp_state``; illegal transitions raise RDMAError (EINVAL).

        Moving to ERR flushes every outstanding WR of both queues with WR_FLUSH_ERR
        (in order, after any completion already generated).
        """

    @abc.abstractmethod
    def post_send(self, wrs: list[SendWR]) -> None:
        """Post a chain of send WRs (see module contract). Raises PostError, ValueError."""

    @abc.abstractmethod
    def post_recv(self, wrs: list[RecvWR]) -> None:
        """Post a chain of receive WRs. Raises PostError."""

    def c_ops(self) -> Any:
        """The QP's C-level posts, for compiled callers: ``(capsule, target)``, the
        PyCapsule named ``CQP_OPS`` (``verbs/cverbs.pxd``) and the object to pass as
        their first argument; None where the provider has none (the default)."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Destroy the QP (outstanding WRs are dropped without completions). Idempotent."""


class PD(abc.ABC):
    """A protection domain: MRs and QPs of one PD only work together."""

    context: Context

    @abc.abstractmethod
    def reg_mr(self, buffer: Any, access: Access = Access.LOCAL_WRITE) -> MR:
        """Register a writable buffer-protocol object.

        Raises TypeError (read-only / non-contiguous), RegistrationError (REMOTE_WRITE or
        REMOTE_ATOMIC without LOCAL_WRITE, or provider refusal). The buffer stays pinned
        (cannot be resized) until ``MR.close()``.
        """

    @abc.abstractmethod
    def create_qp(self, send_cq: CQ, recv_cq: CQ, cap: QPCap) -> QP:
        """A new RC QP in RESET. Raises RDMAError if ``cap`` exceeds device limits."""

    @abc.abstractmethod
    def close(self) -> None:
        """Deallocate; refused (EBUSY) while MRs or QPs remain. Idempotent."""


class Context(abc.ABC):
    """An open device."""

    name: str
    provider: str
    #: True when same-host peers deliver data into ``buffers.SharedMemory`` registered
    #: with this device by a plain memory copy (the ``soft`` provider); callers that
    #: choose how to allocate buffers (rendezvous staging) use shared memory only here
    maps_shared_memory: bool = False
    #: True when CPU copies in the two processes move the bytes of an RDMA READ, not a
    #: device (the ``soft`` provider: the responder's ``process_vm_writev`` or memmove
    #: into the reader's memory, or a socket between them). Reading messages ahead into
    #: staging while the application receives straight into its own registered buffers
    #: then costs the receiving CPU a second copy per byte in its receive's path, and
    #: gains none of the overlap a device gives
    reads_on_cpu: bool = False

    @abc.abstractmethod
    def query_device(self) -> DeviceAttr: ...

    @abc.abstractmethod
    def query_port(self, port_num: int = 1) -> PortAttr: ...

    @abc.abstractmethod
    def query_gid(self, port_num: int = 1, index: int = 0) -> bytes:
        """The 16-byte GID at ``index`` (all zeros for an unused entry)."""

    @abc.abstractmethod
    def gid_index_for(self, ip: str, port_num: int = 1) -> int:
        """The GID index whose address is ``ip`` (RoCE v2: the IPv4-mapped GID).

        Raises DeviceError with a clear message when no GID matches.
        """

    def peer_address_problem(self, gid: bytes, lid: int, seen_ip: str) -> str | None:
        """Why this device should not send to the port ``gid``/``lid`` that a peer
        named over a setup connection coming from ``seen_ip``, or None.

        Devices that open connections of their own to that address (``soft``) refuse an
        address the peer does not have, so that a handshake cannot make them connect
        to a third party. RDMA hardware sends where the fabric routes the GID, often
        over another network than the setup connection's, and cannot check: None.
        """
        return None

    @abc.abstractmethod
    def alloc_pd(self) -> PD: ...

    @abc.abstractmethod
    def create_comp_channel(self) -> CompChannel: ...

    @abc.abstractmethod
    def create_cq(self, cqe: int, channel: CompChannel | None = None) -> CQ:
        """A CQ with room for at least ``cqe`` completions."""

    @property
    @abc.abstractmethod
    def async_fd(self) -> int:
        """A non-blocking fd readable while device async events are queued."""

    @abc.abstractmethod
    def get_async_events(self) -> list[AsyncEvent]:
        """Drain (and acknowledge) every queued async event; never blocks."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the device; refused (EBUSY) while PDs, CQs or channels remain."""


class Provider(abc.ABC):
    """A provider: discovers and opens devices."""

    name: str

    @abc.abstractmethod
    def list_devices(self) -> list[DeviceInfo]: ...

    @abc.abstractmethod
    def open(self, name: str | None = None) -> Context:
        """Open device ``name`` (first device with an active port when ``None``).

        Raises DeviceError when there is no such device.
        """
