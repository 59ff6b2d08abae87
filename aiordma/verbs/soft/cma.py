"""Cross-memory attach (CMA): one kernel copy between two processes on one host.

Used by the soft device for large RDMA WRITE and READ between same-host devices (the
abstract Unix socket path), as UCX's CMA transport and MPI do: instead of streaming the
payload through the socket (two kernel copies), the responder copies it directly with
``process_vm_readv`` (WRITE: from the requester's source into the target MR) or
``process_vm_writev`` (READ: from the source MR into the requester's destination).
The requester sends the addresses of its local SGEs instead of the data (``wire``:
FLAG_CMA). The responder validates exactly as for a socket request; only the data
movement differs.

Contract:

* ``enabled()``: Linux, libc has the calls, and ``AIORDMA_SOFT_CMA`` is not ``0``.
* ``min_size()``: requests of fewer bytes use the socket (``AIORDMA_SOFT_CMA_MIN``,
  default ``DEFAULT_MIN``).
* ``peer_pid(sock)``: the peer's pid from ``SO_PEERCRED`` (kernel-verified, never what
  the peer claims); 0 when unknown (not a Unix socket, another pid namespace).
* ``copy(pid, local, remote, write)``: ``(addr, len)`` lists of equal total length;
  returns 0 when every byte was copied, else an errno (EFAULT, EPERM, ESRCH, ...).
  The caller keeps the local memory alive (holds a view of it) during the call. The
  GIL is released during the system call (ctypes).
* ``probe(pid, addr, cookie)``: True when ``pid``'s 8 bytes at ``addr`` are ``cookie``
  (the peer's ``PROBE_ADDR``/``PROBE_COOKIE``): CMA works between the two processes.
  A connection probes once before its first CMA request and keeps the socket path
  for good when the probe fails.
* ``copies``: how many data copies ran in this process (for tests and diagnostics).

Shared memory (``PeerMaps``, wire ``FLAG_SHM``): a READ whose destination is one
``buffers.SharedMemory`` buffer of the requester (aiordma's rendezvous staging on this
provider) also names that buffer (its fd in the requester, its inode, the offset). The
responder maps the buffer once (``/proc/<pid>/fd/<fd>``, the same permission CMA needs;
the inode must match, the size must be sealed against shrinking so that a peer cannot
make the copy fault) and copies the data with ``memmove``: about a quarter of the cost
of ``process_vm_writev``, which pins each remote page first. Anything else -- the
mapping is refused, the range does not fit -- uses the CMA copy as before.

* ``PeerMaps(pid).target(fd, ino, offset, n)``: ``(keepalive, address)`` of the peer's
  bytes ``[offset, offset + n)`` of that buffer, mapped here, or None. Mappings are
  cached by inode (an inode cannot be reused while mapped), at most ``PEER_MAPS`` and
  ``PEER_MAP_BYTES`` per peer connection (but always the newest one), least recently
  used dropped first. A mapping keeps a buffer's memory alive after the peer freed it,
  so a miss first drops (``sweep``, at most every ``PEER_SWEEP_S``) the mappings whose
  fd in the peer no longer names their buffer. ``keepalive`` holds the mapping while a
  copy uses it.
* ``shm_copies``: how many copies went through a shared mapping; ``shm_maps``: how many
  times a peer's buffer was looked up to be mapped (cache misses).
* ``SHM_MIN``: READs into shared memory take this path from this size on, below the
  CMA threshold too.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import random
import socket
import stat
import struct
import sys
import time
from collections import OrderedDict
from typing import Any

from .admission import peer_credentials

DEFAULT_MIN = 256 * 1024
#: the kernel's IOV_MAX: longer SGE lists use the socket
IOV_MAX = 1024

IOV = struct.Struct("<QQ")


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _bind() -> tuple[Any, Any] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fns = libc.process_vm_readv, libc.process_vm_writev
    except (OSError, AttributeError):  # pragma: no cover - old libc
        return None
    for fn in fns:
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                       ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
    return fns


_FNS = _bind()

_probe_word = ctypes.c_uint64(random.getrandbits(64) | 1)
PROBE_ADDR: int = ctypes.addressof(_probe_word)
PROBE_COOKIE: int = _probe_word.value


def enabled() -> bool:
    return _FNS is not None and os.environ.get("AIORDMA_SOFT_CMA", "1") != "0"


def min_size() -> int:
    try:
        return max(1, int(os.environ.get("AIORDMA_SOFT_CMA_MIN", DEFAULT_MIN)))
    except ValueError:
        return DEFAULT_MIN


def peer_pid(sock: socket.socket) -> int:
    """The pid of a Unix socket's peer, 0 if unknown or not a Unix socket."""
    cred = peer_credentials(sock)
    return cred[0] if cred is not None and cred[0] > 0 else 0


def address_of(view: memoryview) -> int:
    """The address of a writable, contiguous memoryview (MR slices always are)."""
    return ctypes.addressof((ctypes.c_char * len(view)).from_buffer(view))


def pack_iov(pairs: list[tuple[int, int]]) -> bytes:
    return b"".join(IOV.pack(a, n) for a, n in pairs)


def unpack_iov(buf: bytes | bytearray | memoryview) -> list[tuple[int, int]]:
    return [IOV.unpack_from(buf, i) for i in range(0, len(buf) - IOV.size + 1, IOV.size)]


def _array(pairs: list[tuple[int, int]]) -> Any:
    arr = (_IOVec * len(pairs))()
    for i, (a, n) in enumerate(pairs):
        arr[i].base = a
        arr[i].len = n
    return arr


def _skip(pairs: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    out = []
    for a, k in pairs:
        if n >= k:
            n -= k
            continue
        out.append((a + n, k - n))
        n = 0
    return out


copies = 0


def copy(pid: int, local: list[tuple[int, int]], remote: list[tuple[int, int]],
         write: bool) -> int:
    global copies
    copies += 1
    if _FNS is None:
        return errno.ENOSYS
    fn = _FNS[1] if write else _FNS[0]
    total = sum(n for _, n in local)
    if total != sum(n for _, n in remote) or len(local) > IOV_MAX or len(remote) > IOV_MAX:
        return errno.EINVAL
    while total:
        done = fn(pid, _array(local), len(local), _array(remote), len(remote), 0)
        if done < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            return err or errno.EFAULT
        if done == 0:
            return errno.EFAULT
        total -= done
        if total:  # partial: a fault at an iovec boundary; retry the rest once more
            local, remote = _skip(local, done), _skip(remote, done)
    return 0


def probe(pid: int, addr: int, cookie: int) -> bool:
    if pid <= 0 or not enabled():
        return False
    word = ctypes.c_uint64(0)
    if copy(pid, [(ctypes.addressof(word), 8)], [(addr, 8)], write=False):
        return False
    return word.value == cookie


#: READs into shared memory use it from this size on, even below ``min_size()``: a
#: ``memmove`` costs no page pinning, so it beats the socket's two copies early
SHM_MIN = 4096
#: shared mappings kept per peer connection (``PeerMaps``) and the bytes they may span:
#: room for every buffer a peer can share (``buffers.SHARED_MAX_BUFFERS``: a smaller
#: cache thrashes -- a mapping per message -- once a deep read-ahead cycles through more
#: staging buffers than it holds)
PEER_MAPS = 256
PEER_MAP_BYTES = 4 << 30
#: at most this often (seconds), a miss first drops the mappings of buffers the peer
#: has closed (a mapping keeps a buffer's memory alive after its owner freed it)
PEER_SWEEP_S = 1.0
_REFUSED_MAX = 1024
shm_copies = 0
shm_maps = 0


class PeerMaps:
    """The peer process's ``SharedMemory`` buffers mapped into this one (see above).
    Used by one thread at a time (the connection's input processing)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        # ino -> (keepalive, address, size, fd in the peer)
        self._maps: OrderedDict[int, tuple[Any, int, int, int]] = OrderedDict()
        self._refused: set[tuple[int, int]] = set()
        self._bytes = 0  # mapped in all
        self._swept = time.monotonic()

    def target(self, fd: int, ino: int, offset: int, n: int) -> tuple[Any, int] | None:
        global shm_maps
        m = self._maps.get(ino)
        if m is None:
            if self.pid <= 0 or (fd, ino) in self._refused:
                return None
            now = time.monotonic()
            if now - self._swept >= PEER_SWEEP_S:
                self._swept = now
                self.sweep()
            shm_maps += 1
            m = self._open(fd, ino)
            if m is None:
                if len(self._refused) >= _REFUSED_MAX:
                    self._refused.clear()
                self._refused.add((fd, ino))
                return None
            self._maps[ino] = m
            self._bytes += m[2]
            while len(self._maps) > 1 and (len(self._maps) > PEER_MAPS
                                           or self._bytes > PEER_MAP_BYTES):
                self._bytes -= self._maps.popitem(last=False)[1][2]
        else:
            self._maps.move_to_end(ino)
        keep, addr, size, _fd = m
        if offset < 0 or n < 0 or offset + n > size:
            return None
        return keep, addr + offset

    def sweep(self) -> None:
        """Drop the mappings of buffers whose fd in the peer no longer names them."""
        for ino, m in list(self._maps.items()):
            try:
                alive = os.stat(f"/proc/{self.pid}/fd/{m[3]}").st_ino == ino
            except OSError:
                alive = False
            if not alive:
                del self._maps[ino]
                self._bytes -= m[2]

    def _open(self, fd: int, ino: int) -> tuple[Any, int, int, int] | None:
        path = f"/proc/{self.pid}/fd/{fd}"
        try:
            # what the peer's fd names, before opening it (opening a device can act)
            st = os.stat(path)
            if st.st_ino != ino or not stat.S_ISREG(st.st_mode):
                return None
            f = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            st = os.fstat(f)
            if st.st_ino != ino or not stat.S_ISREG(st.st_mode) or st.st_size <= 0:
                return None
            if not fcntl.fcntl(f, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
                return None
            mp = mmap.mmap(f, st.st_size)
        except (OSError, ValueError, AttributeError):
            return None
        finally:
            os.close(f)
        keep = (ctypes.c_char * st.st_size).from_buffer(mp)  # holds the mapping
        return keep, ctypes.addressof(keep), st.st_size, fd

    def clear(self) -> None:
        self._maps.clear()
        self._bytes = 0


def memmove(dst: int, src: int, n: int) -> None:
    """One shared-mapping copy (GIL released: ctypes)."""
    global shm_copies
    shm_copies += 1
    ctypes.memmove(dst, src, n)
