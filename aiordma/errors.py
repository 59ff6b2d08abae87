"""Exception hierarchy of aiordma (a leaf module: every layer may import it).

``RDMAError(OSError)`` is the root. Completion errors carry the ibv_wc_status of the
work completion that failed; ``completion_error(wc)`` maps a failed completion to the
matching subclass.
"""

from __future__ import annotations

import errno


class RDMAError(OSError):
    """Root of every aiordma error."""


class PostError(RDMAError):
    """A work request was refused by the provider before it was posted.

    ``errno`` is ``EINVAL`` (bad state or argument) or ``ENOMEM`` (queue full).
    """


class DeviceError(RDMAError):
    """No such device, no active port, or a device-level failure."""


class RegistrationError(RDMAError):
    """Memory registration was refused (bad access flags, bad buffer)."""


class CQOverrunError(RDMAError):
    """A completion queue overflowed: completions were lost, the CQ is in error."""

    def __init__(self, msg: str = "completion queue overrun") -> None:
        super().__init__(errno.EOVERFLOW, msg)


class CompletionError(RDMAError):
    """A work completion came back with an error status.

    Attributes: ``status`` (a ``WCStatus``; ``str(status)`` is the ibv_wc_status name),
    ``vendor_err``, ``wr_id``, ``opcode``.
    """

    def __init__(
        self,
        status: int,
        *,
        vendor_err: int = 0,
        wr_id: int = 0,
        opcode: int | None = None,
        msg: str | None = None,
    ) -> None:
        text = msg or f"work completion failed: {status} (vendor_err={vendor_err:#x})"
        super().__init__(errno.EIO, text)
        self.status = status
        self.vendor_err = vendor_err
        self.wr_id = wr_id
        self.opcode = opcode

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_rebuild_completion_error, (type(self), self.status, self.vendor_err, self.wr_id))


def _rebuild_completion_error(cls: type, status: int, vendor_err: int, wr_id: int) -> CompletionError:
    err: CompletionError = cls(status, vendor_err=vendor_err, wr_id=wr_id)
    return err


class RemoteAccessError(CompletionError):
    """IBV_WC_REM_ACCESS_ERR: bad rkey, range outside the remote MR, or right not granted."""


class LocalLengthError(CompletionError):
    """IBV_WC_LOC_LEN_ERR: the receive buffer was too small for the incoming message."""


class LocalProtectionError(CompletionError):
    """IBV_WC_LOC_PROT_ERR: bad lkey, local SGE outside its MR, or MR of another PD."""


class LocalQPOperationError(CompletionError):
    """IBV_WC_LOC_QP_OP_ERR: an internal QP consistency error (e.g. SGE count)."""


class RemoteOperationError(CompletionError):
    """IBV_WC_REM_OP_ERR / IBV_WC_REM_INV_REQ_ERR: the responder could not complete it."""


class RemoteInvalidRequestError(RemoteOperationError):
    """IBV_WC_REM_INV_REQ_ERR: the responder rejected the request (e.g. too long)."""


class RetryExceededError(CompletionError):
    """IBV_WC_RETRY_EXC_ERR: the peer stopped acknowledging (gone, unreachable)."""


class RNRRetryExceededError(CompletionError):
    """IBV_WC_RNR_RETRY_EXC_ERR: the peer had no receive posted, rnr_retry ran out."""


class FlushedError(CompletionError):
    """IBV_WC_WR_FLUSH_ERR: the QP went to the error state before this WR ran.

    ``__cause__`` is the first real error of the QP, where there was one.
    """


class ConnectionClosed(RDMAError, ConnectionResetError):
    """The endpoint or transport is closed (locally, by the peer, or by a failure).

    ``__cause__`` carries the underlying error, if any (e.g. a ``RetryExceededError``).
    """

    def __init__(self, msg: str = "connection closed") -> None:
        super().__init__(errno.ECONNRESET, msg)


class PeerUnresponsive(RDMAError, TimeoutError):
    """The peer answered no heartbeat on the setup connection for ``liveness_timeout``
    seconds: its process is frozen (stopped, or its event loop blocked), or its host
    is down or unreachable. The endpoint fails with it: every pending operation raises
    ``ConnectionClosed`` whose ``__cause__`` it is."""

    def __init__(self, msg: str) -> None:
        super().__init__(errno.ETIMEDOUT, msg)


class ConnectionRefused(RDMAError, ConnectionRefusedError):
    """The peer refused the connection (nothing listening, or rejected in the handshake)."""

    def __init__(self, msg: str = "connection refused") -> None:
        super().__init__(errno.ECONNREFUSED, msg)


class HandshakeError(RDMAError):
    """Connection setup failed: garbage, truncated or oversize frames, version mismatch,
    or a step that timed out."""

    def __init__(self, msg: str) -> None:
        super().__init__(errno.EPROTO, msg)


class HandshakeTimeout(HandshakeError, TimeoutError):
    """A step of connection setup took longer than its timeout; the message says which
    step (what was waited for) and how long."""

    def __init__(self, msg: str) -> None:
        OSError.__init__(self, errno.ETIMEDOUT, msg)


class AuthenticationError(HandshakeError):
    """The peer failed the shared-secret authentication of connection setup (wrong or
    missing ``secret=``), or a peer that must authenticate did not."""


class ResourceLimitError(RDMAError):
    """A per-process or system limit refused a resource: ``errno`` is EMFILE (the
    process's ``RLIMIT_NOFILE``, named in the message) or ENFILE (the system's file
    table), or ENOMEM. Nothing half-made is left behind."""


def fd_limit_error(exc: OSError, what: str) -> ResourceLimitError | None:
    """The ``ResourceLimitError`` for ``exc`` when it is EMFILE/ENFILE (else None):
    ``what`` says what could not be opened; the message names the limit."""
    if exc.errno == errno.EMFILE:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        err = ResourceLimitError(errno.EMFILE, f"{what}: too many open files (this process's "
                                 f"RLIMIT_NOFILE is {soft}; raise it with `ulimit -n`)")
    elif exc.errno == errno.ENFILE:
        err = ResourceLimitError(errno.ENFILE, f"{what}: the system's file table is full "
                                 "(fs.file-max)")
    else:
        return None
    err.__cause__ = exc
    return err


class MessageTooLarge(RDMAError, ValueError):
    """A message exceeds ``max_message_size``, or ``recv_into``'s buffer is too small
    (the message is kept for the next receive). ``.size`` is the message length."""

    def __init__(self, msg: str, size: int = 0) -> None:
        super().__init__(errno.EMSGSIZE, msg)
        self.size = size


def completion_error(
    status: int,
    *,
    vendor_err: int = 0,
    wr_id: int = 0,
    opcode: int | None = None,
) -> CompletionError:
    """The typed ``CompletionError`` subclass for a failed completion's status."""
    cls = _BY_STATUS.get(int(status), CompletionError)
    return cls(status, vendor_err=vendor_err, wr_id=wr_id, opcode=opcode)


# ibv_wc_status values (verbs/enums.py WCStatus; this leaf module does not import it)
_BY_STATUS: dict[int, type[CompletionError]] = {
    10: RemoteAccessError,  # REM_ACCESS_ERR
    1: LocalLengthError,  # LOC_LEN_ERR
    4: LocalProtectionError,  # LOC_PROT_ERR
    2: LocalQPOperationError,  # LOC_QP_OP_ERR
    11: RemoteOperationError,  # REM_OP_ERR
    9: RemoteInvalidRequestError,  # REM_INV_REQ_ERR
    12: RetryExceededError,  # RETRY_EXC_ERR
    13: RNRRetryExceededError,  # RNR_RETRY_EXC_ERR
    5: FlushedError,  # WR_FLUSH_ERR
}
