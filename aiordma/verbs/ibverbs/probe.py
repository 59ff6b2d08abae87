"""What pyverbs hides, found in the process itself: the file descriptors (the completion
channel's before rdma-core 57, the context's async fd in every version) and the C
pointers (``struct ibv_context``/``ibv_comp_channel``/``ibv_cq``/``ibv_qp``) behind
pyverbs' objects, for the ctypes and compiled data paths. No pyverbs import here.

* fds: ``event_fds``/``new_event_fd`` (what ``/proc/self/fd`` gained), ``readable``,
  ``set_nonblocking``;
* pointers: ``object_words`` (a Python object's words), ``ProcSelfMem`` (reads that
  fail instead of faulting), ``find_context_pointer``, ``find_channel``,
  ``find_cq_pointer``, ``find_qp_pointer`` (a candidate is taken only when exactly one
  word points to a struct whose members match what is known of it: see the package
  docstring for the method and why it is safe).

The struct offsets are ``compat``'s (verbs.h, checked against the headers by the
compiled path's ``abi()``).
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping

from .compat import (
    CHANNEL_FD_OFFSET,
    CHANNEL_SIZE,
    CQ_CQ_CONTEXT_OFFSET,
    CQ_PROBE_SIZE,
    CTX_ASYNC_FD_OFFSET,
    CTX_CMD_FD_OFFSET,
    CTX_NUM_COMP_VECTORS_OFFSET,
    CTX_PROBE_SIZE,
    QP_PROBE_SIZE,
    QP_QP_NUM_OFFSET,
    QP_RECV_CQ_OFFSET,
    QP_SEND_CQ_OFFSET,
)

_WORD = struct.Struct("=Q")
_INT = struct.Struct("=i")
_PTR_MIN = 0x10000
_PTR_MAX = 1 << 56  # canonical user-space addresses (x86-64 5-level paging: 2**56)

PROC_SELF_FD = "/proc/self/fd"


def set_nonblocking(fd: int) -> None:
    """Set O_NONBLOCK on ``fd`` (fcntl F_SETFL)."""
    os.set_blocking(fd, False)


def is_event_fd_target(target: str) -> bool:
    """True for the ``/proc/self/fd`` link target of a verbs event file.

    Completion channels and the context's async event file are anonymous inodes named
    ``[infinibandevent]`` by the kernel's uverbs driver.
    """
    return target.startswith("anon_inode:") and "infiniband" in target


def readable(fd: int) -> bool:
    """Whether ``fd`` is readable now (``select`` with a zero timeout; False for a
    closed or invalid fd)."""
    try:
        r, _, _ = select.select([fd], [], [], 0)
    except (OSError, ValueError):
        return False
    return bool(r)


def fd_target(fd: int, proc_fd: str = PROC_SELF_FD) -> str | None:
    try:
        return os.readlink(f"{proc_fd}/{fd}")
    except OSError:
        return None


def is_event_fd(fd: int, proc_fd: str = PROC_SELF_FD) -> bool:
    target = fd_target(fd, proc_fd)
    return target is not None and is_event_fd_target(target)


def event_fds(proc_fd: str = PROC_SELF_FD) -> dict[int, str]:
    """``{fd: link target}`` of the verbs event files open in this process."""
    out: dict[int, str] = {}
    try:
        names = os.listdir(proc_fd)
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        target = fd_target(int(name), proc_fd)
        if target is not None and is_event_fd_target(target):
            out[int(name)] = target
    return out


def new_event_fd(before: Mapping[int, str], after: Mapping[int, str]) -> int | None:
    """The single event fd present in ``after`` but not in ``before`` (None if not one)."""
    new = [fd for fd, target in after.items() if before.get(fd) != target]
    return new[0] if len(new) == 1 else None


class ProcSelfMem:
    """Fault-free reads of this process's memory through ``/proc/self/mem``.

    A read of an unmapped address fails with EIO/EFAULT instead of crashing the process,
    which makes it safe to test whether a word of a pyverbs object is a pointer to a
    given libibverbs struct.
    """

    def __init__(self, path: str = "/proc/self/mem") -> None:
        self._path = path
        self._fd: int | None = None

    def read(self, addr: int, size: int) -> bytes | None:
        if not _PTR_MIN <= addr < _PTR_MAX:
            return None
        try:
            if self._fd is None:
                self._fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
            data = os.pread(self._fd, size, addr)
        except (OSError, OverflowError, ValueError):
            return None
        return data if len(data) == size else None

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:  # pragma: no cover
                pass
            self._fd = None


MemRead = Callable[[int, int], "bytes | None"]
FdCheck = Callable[[int], bool]


def object_words(obj: object) -> list[int]:
    """The pointer-aligned words of a (Cython) object's own C struct, after the header.

    Reads ``type(obj).__basicsize__`` bytes at ``id(obj)``: the object's own allocation,
    so this never touches foreign memory.
    """
    size = type(obj).__basicsize__
    raw = ctypes.string_at(id(obj), size)
    start = 2 * _WORD.size  # ob_refcnt, ob_type
    return [_WORD.unpack_from(raw, off)[0] for off in range(start, size - _WORD.size + 1,
                                                            _WORD.size)]


def plausible_pointer(word: int) -> bool:
    return _PTR_MIN <= word < _PTR_MAX and word % 8 == 0


def _readable_pointers(words: Iterable[int], size: int,
                       read: MemRead) -> Iterator[tuple[int, bytes]]:
    """``(word, the size bytes at it)`` for each distinct plausible pointer among
    ``words`` whose memory can be read."""
    for w in dict.fromkeys(words):
        if plausible_pointer(w):
            raw = read(w, size)
            if raw is not None:
                yield w, raw


def find_context_pointer(words: Iterable[int], cmd_fd: int, read: MemRead,
                         fd_ok: FdCheck) -> int | None:
    """The ``struct ibv_context *`` among ``words`` (the fields of a pyverbs Context).

    A candidate qualifies when the struct it points to holds ``cmd_fd`` (which pyverbs
    exposes as ``Context.cmd_fd``), an ``async_fd`` that is an open verbs event file, and
    a sane ``num_comp_vectors``. Exactly one candidate must qualify.
    """
    found: list[int] = []
    for w, raw in _readable_pointers(words, CTX_PROBE_SIZE, read):
        cfd = _INT.unpack_from(raw, CTX_CMD_FD_OFFSET)[0]
        afd = _INT.unpack_from(raw, CTX_ASYNC_FD_OFFSET)[0]
        ncv = _INT.unpack_from(raw, CTX_NUM_COMP_VECTORS_OFFSET)[0]
        if cfd == cmd_fd and afd >= 0 and afd != cfd and 0 < ncv <= 65536 and fd_ok(afd):
            found.append(w)
    return found[0] if len(found) == 1 else None


def find_channel(words: Iterable[int], ctx_ptr: int, read: MemRead, fd_ok: FdCheck, *,
                 fd: int | None = None,
                 candidates: Iterable[int] | None = None) -> tuple[int, int] | None:
    """``(pointer, fd)`` of the ``struct ibv_comp_channel`` one of ``words`` points to.

    The struct must start with ``ctx_ptr`` and hold an fd that is an open verbs event
    file; equal to ``fd`` when it is known (pyverbs >= 57), else one of ``candidates`` (the
    event fds that appeared while the channel was created) when given. Exactly one
    pointer must qualify.
    """
    allowed = None if candidates is None else set(candidates)
    found: list[tuple[int, int]] = []
    for w, raw in _readable_pointers(words, CHANNEL_SIZE, read):
        owner = _WORD.unpack_from(raw, 0)[0]
        cfd = _INT.unpack_from(raw, CHANNEL_FD_OFFSET)[0]
        if owner != ctx_ptr or cfd < 0:
            continue
        if fd is not None and cfd != fd:
            continue
        if allowed is not None and cfd not in allowed:
            continue
        if fd_ok(cfd):
            found.append((w, cfd))
    return found[0] if len(found) == 1 else None


def find_cq_pointer(words: Iterable[int], ctx_ptr: int, cq_context: int,
                    read: MemRead) -> int | None:
    """The ``struct ibv_cq *`` among ``words`` (the fields of a pyverbs CQ): the struct
    must start with ``ctx_ptr`` and hold ``cq_context`` (the token the CQ was created
    with). Exactly one pointer must qualify."""
    found: list[int] = []
    for w, raw in _readable_pointers(words, CQ_PROBE_SIZE, read):
        if (_WORD.unpack_from(raw, 0)[0] == ctx_ptr
                and _WORD.unpack_from(raw, CQ_CQ_CONTEXT_OFFSET)[0] == cq_context):
            found.append(w)
    return found[0] if len(found) == 1 else None


def find_qp_pointer(words: Iterable[int], ctx_ptr: int, qp_num: int, send_cq: int,
                    recv_cq: int, read: MemRead) -> int | None:
    """The ``struct ibv_qp *`` among ``words`` (the fields of a pyverbs QP): the struct
    must start with ``ctx_ptr``, hold ``qp_num``, and the ``struct ibv_cq *`` of its
    send and receive CQs where known (non-zero). Exactly one pointer must qualify."""
    found: list[int] = []
    for w, raw in _readable_pointers(words, QP_PROBE_SIZE, read):
        if (_WORD.unpack_from(raw, 0)[0] == ctx_ptr
                and struct.unpack_from("=I", raw, QP_QP_NUM_OFFSET)[0] == qp_num
                and (not send_cq or _WORD.unpack_from(raw, QP_SEND_CQ_OFFSET)[0] == send_cq)
                and (not recv_cq or _WORD.unpack_from(raw, QP_RECV_CQ_OFFSET)[0] == recv_cq)):
            found.append(w)
    return found[0] if len(found) == 1 else None
