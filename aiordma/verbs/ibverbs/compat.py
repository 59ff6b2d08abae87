"""Pure-Python shims of the ``verbs`` provider (no pyverbs import here).

Everything that differs between pyverbs/rdma-core versions, or that pyverbs does not
expose, is isolated here so that it can be unit-tested without RDMA hardware:

* the enum module (``pyverbs.enums`` up to rdma-core 49, ``pyverbs.libibverbs_enums``
  from 50; flat ``IBV_*`` names or ``cpdef enum`` classes) -> ``EnumTable``;
* the errno of a pyverbs exception -> ``errno_of``;
* the file descriptors and C pointers pyverbs hides -> ``probe.py``;
* immediate data byte order, work-completion conversion -> ``imm_to_wire``,
  ``imm_from_wire``, ``convert_wc``;
* GID selection for an IP address from sysfs -> ``read_sysfs_gids``, ``select_gid_index``.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib
import ipaddress
import os
import re
import socket
import struct
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import DeviceError
from ..enums import WCOpcode, WCStatus
from ..wr import WC

# ----------------------------------------------------------------------------------------
# rdma-core ABI constants (libibverbs/verbs.h; stable since libibverbs 1.1)
# ----------------------------------------------------------------------------------------

#: Fallback values of the enum names the provider uses (used only if a pyverbs build
#: lacks one; each equals the C enum value).
ABI_ENUMS: dict[str, int] = {
    "IBV_QPT_RC": 2,
    "IBV_QP_STATE": 1 << 0,
    "IBV_QP_CUR_STATE": 1 << 1,
    "IBV_QP_ACCESS_FLAGS": 1 << 3,
    "IBV_QP_PKEY_INDEX": 1 << 4,
    "IBV_QP_PORT": 1 << 5,
    "IBV_QP_AV": 1 << 7,
    "IBV_QP_PATH_MTU": 1 << 8,
    "IBV_QP_TIMEOUT": 1 << 9,
    "IBV_QP_RETRY_CNT": 1 << 10,
    "IBV_QP_RNR_RETRY": 1 << 11,
    "IBV_QP_RQ_PSN": 1 << 12,
    "IBV_QP_MAX_QP_RD_ATOMIC": 1 << 13,
    "IBV_QP_MIN_RNR_TIMER": 1 << 15,
    "IBV_QP_SQ_PSN": 1 << 16,
    "IBV_QP_MAX_DEST_RD_ATOMIC": 1 << 17,
    "IBV_QP_DEST_QPN": 1 << 20,
    "IBV_LINK_LAYER_UNSPECIFIED": 0,
    "IBV_LINK_LAYER_INFINIBAND": 1,
    "IBV_LINK_LAYER_ETHERNET": 2,
}

#: ``struct ibv_context``: ``device`` (8 bytes), ``ops`` (32 function pointers), then
#: ``int cmd_fd; int async_fd; int num_comp_vectors``.
CTX_CMD_FD_OFFSET = 8 + 32 * 8
CTX_ASYNC_FD_OFFSET = CTX_CMD_FD_OFFSET + 4
CTX_NUM_COMP_VECTORS_OFFSET = CTX_CMD_FD_OFFSET + 8
CTX_PROBE_SIZE = CTX_NUM_COMP_VECTORS_OFFSET + 4
#: ``struct ibv_comp_channel {struct ibv_context *context; int fd; int refcnt;}``
CHANNEL_FD_OFFSET = 8
CHANNEL_SIZE = 16
#: ``struct ibv_qp``: six pointers, ``uint32_t handle``, ``uint32_t qp_num``.
QP_QP_NUM_OFFSET = 6 * 8 + 4
#: ``struct ibv_qp``: ``context``, ``qp_context``, ``pd``, ``send_cq``, ``recv_cq``.
QP_SEND_CQ_OFFSET = 3 * 8
QP_RECV_CQ_OFFSET = 4 * 8
QP_PROBE_SIZE = QP_QP_NUM_OFFSET + 4
#: ``struct ibv_cq``: ``context``, ``channel``, ``void *cq_context``.
CQ_CQ_CONTEXT_OFFSET = 2 * 8
CQ_PROBE_SIZE = CQ_CQ_CONTEXT_OFFSET + 8
#: ``ctx->ops.poll_cq``: the 12th function pointer of ``struct ibv_context_ops`` (after
#: ``_compat_query_device`` .. ``dealloc_mw`` and ``_compat_create_cq``), which is what
#: the inline ``ibv_poll_cq`` of verbs.h calls.
CTX_OPS_POLL_CQ_OFFSET = 8 + 11 * 8
#: ``ctx->ops.req_notify_cq``: the one after it (what the inline ``ibv_req_notify_cq`` calls).
CTX_OPS_REQ_NOTIFY_CQ_OFFSET = CTX_OPS_POLL_CQ_OFFSET + 8
#: ``ctx->ops.post_send``/``post_recv``: the 26th and 27th (what ibv_post_send/recv call).
CTX_OPS_POST_SEND_OFFSET = 8 + 25 * 8
CTX_OPS_POST_RECV_OFFSET = 8 + 26 * 8
#: ``struct ibv_wc`` (48 bytes): ``uint64_t wr_id; enum status, opcode; uint32_t
#: vendor_err, byte_len; __be32 imm_data; uint32_t qp_num, src_qp; unsigned wc_flags;
#: uint16_t pkey_index, slid; uint8_t sl, dlid_path_bits`` and 2 bytes of padding.
IBV_WC = struct.Struct("=QIIIIIIIIHHBB2x")


# ----------------------------------------------------------------------------------------
# enums
# ----------------------------------------------------------------------------------------

ENUM_MODULES = ("pyverbs.libibverbs_enums", "pyverbs.enums")


class EnumTable:
    """``IBV_*`` name -> int, from a pyverbs enum module of any version.

    rdma-core < 50 exposes flat module attributes (``e.IBV_QPT_RC``); from 50 the module is
    built from ``cpdef enum`` declarations, whose members live in enum classes
    (``ibv_qp_type.IBV_QPT_RC``) and, depending on the Cython version, also at module
    level. Both are collected; ``ABI_ENUMS`` fills any gap.
    """

    def __init__(self, module: Any | None, fallback: Mapping[str, int] = ABI_ENUMS) -> None:
        table: dict[str, int] = dict(fallback)
        self.source = getattr(module, "__name__", "builtin")
        if module is not None:
            for attr in dir(module):
                try:
                    val = getattr(module, attr)
                except Exception:  # pragma: no cover - exotic module attribute
                    continue
                if attr.startswith("IBV_") and isinstance(val, int):
                    table[attr] = int(val)
                elif isinstance(val, type) and attr.startswith("ibv_"):
                    for name in dir(val):
                        if not name.startswith("IBV_"):
                            continue
                        try:
                            table.setdefault(name, int(getattr(val, name)))
                        except (TypeError, ValueError):
                            continue
        self._table = table

    def __getitem__(self, name: str) -> int:
        return self._table[name]

    def get(self, name: str, default: int | None = None) -> int | None:
        return self._table.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._table


def import_enums(importer: Callable[[str], Any] = importlib.import_module) -> EnumTable:
    """The enum table of the installed pyverbs (``libibverbs_enums`` first, then ``enums``)."""
    errors = []
    for name in ENUM_MODULES:
        try:
            mod = importer(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        table = EnumTable(mod)
        if table.source == "builtin":
            table.source = name
        return table
    raise ImportError("no pyverbs enum module found (" + "; ".join(errors) + ")")


def parse_version(text: object) -> tuple[int, ...] | None:
    """``"65.0"`` -> ``(65, 0)``; None when absent or unparsable."""
    if not isinstance(text, str):
        return None
    m = re.match(r"(\d+)(?:\.(\d+))?", text)
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


# ----------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------

_ERRNO_RE = re.compile(r"Errno: (\d+)")


def errno_of(exc: BaseException, default: int = errno.EINVAL) -> int:
    """The errno of a pyverbs exception (``error_code``, else ``Errno: N`` in the text)."""
    code = getattr(exc, "error_code", None)
    if isinstance(code, int) and code > 0:
        return code
    if isinstance(code, int) and code < -1:  # some calls pass a negative errno
        return -code
    m = _ERRNO_RE.search(str(exc))
    if m:
        return int(m.group(1))
    return default



# ----------------------------------------------------------------------------------------
# immediate data and work completions
# ----------------------------------------------------------------------------------------


def imm_to_wire(value: int) -> int:
    """The ``ibv_send_wr.imm_data`` field (``__be32``) for the integer the user passed.

    pyverbs stores the Python int into the big-endian field as is, so the host-order
    integer is byte-swapped here (``htonl``): the wire then carries the value in network
    byte order, as C programs using ``htonl(imm)`` expect, on any host.
    """
    return socket.htonl(value & 0xFFFFFFFF)


def imm_from_wire(raw: int) -> int:
    """The integer the sender passed, from ``ibv_wc.imm_data`` (``ntohl``)."""
    return socket.ntohl(raw & 0xFFFFFFFF)


_STATUS = {int(s): s for s in WCStatus}
_OPCODE = {int(o): o for o in WCOpcode}
WC_FLAG_WITH_IMM = 2


def to_status(value: int) -> WCStatus:
    """ibv_wc_status int -> WCStatus (unknown values become GENERAL_ERR)."""
    return _STATUS.get(int(value), WCStatus.GENERAL_ERR)


def to_wc_opcode(value: int, hint: WCOpcode | None = None) -> WCOpcode:
    """ibv_wc_opcode int -> WCOpcode; ``hint`` for values outside our enum."""
    op = _OPCODE.get(int(value))
    if op is not None:
        return op
    if hint is not None:
        return hint
    return WCOpcode.RECV if int(value) & 0x80 else WCOpcode.SEND


#: A completion's fields in ``struct ibv_wc`` order, as ints: ``(wr_id, status, opcode,
#: vendor_err, byte_len, imm_data, qp_num, src_qp, wc_flags)`` (``IBV_WC`` unpacks to
#: these and four more).
RawWC = tuple[int, ...]


def pwc_fields(pwc: Any) -> RawWC:
    """The ``RawWC`` fields of a pyverbs ``WC`` (or anything with its attributes)."""
    return (int(pwc.wr_id), int(pwc.status), int(pwc.opcode), int(pwc.vendor_err),
            int(pwc.byte_len), int(pwc.imm_data), int(pwc.qp_num), int(pwc.src_qp),
            int(pwc.wc_flags))


def wc_from_fields(raw: RawWC, opcode_hint: WCOpcode | None = None) -> WC:
    """``RawWC`` -> our ``WC`` (extra trailing fields are ignored).

    For an error status the hardware opcode is undefined, so ``opcode_hint`` (what the
    provider knows of the work request) wins when given.
    """
    status = _STATUS.get(raw[1], WCStatus.GENERAL_ERR)  # to_status, inlined
    flags = raw[8]
    if status is not WCStatus.SUCCESS and opcode_hint is not None:
        opcode = opcode_hint
    else:
        op = _OPCODE.get(raw[2])
        opcode = op if op is not None else to_wc_opcode(raw[2], opcode_hint)
    return WC(raw[0], status, opcode, raw[4], vendor_err=raw[3],
              imm_data=imm_from_wire(raw[5]) if flags & WC_FLAG_WITH_IMM else 0,
              qp_num=raw[6], src_qp=raw[7], wc_flags=flags)


def convert_wc(pwc: Any, opcode_hint: WCOpcode | None = None) -> WC:
    """A pyverbs ``WC`` (or anything with its attributes) -> our ``WC``
    (``wc_from_fields`` of ``pwc_fields``)."""
    return wc_from_fields(pwc_fields(pwc), opcode_hint)


# ----------------------------------------------------------------------------------------
# GIDs
# ----------------------------------------------------------------------------------------

SYSFS_INFINIBAND = "/sys/class/infiniband"
ROCE_V2 = "RoCE v2"
_V4_MAPPED = b"\0" * 10 + b"\xff\xff"
ZERO_GID = b"\0" * 16


@dataclasses.dataclass(frozen=True)
class GidEntry:
    index: int
    gid: bytes
    gid_type: str | None = None  # "RoCE v2", "IB/RoCE v1", or None when unknown


def gid_from_str(text: str) -> bytes:
    """``"0000:...:0a00:020f"`` (sysfs / pyverbs ``str(GID)``) -> 16 bytes."""
    raw = bytes.fromhex(text.strip().replace(":", ""))
    if len(raw) != 16:
        raise ValueError(f"not a GID: {text!r}")
    return raw


def gid_for_ip(ip: str) -> bytes:
    """The GID of an IP address: IPv4-mapped IPv6 for IPv4, the address for IPv6."""
    a = ipaddress.ip_address(ip)
    if isinstance(a, ipaddress.IPv4Address):
        return _V4_MAPPED + a.packed
    return a.packed


def format_gid(gid: bytes) -> str:
    """A readable GID: the IPv4 address for an IPv4-mapped GID, else IPv6 notation."""
    if gid[:12] == _V4_MAPPED:
        return socket.inet_ntoa(gid[12:])
    return str(ipaddress.IPv6Address(gid))


def read_sysfs_gids(dev: str, port: int, root: str = SYSFS_INFINIBAND) -> list[GidEntry] | None:
    """The non-zero GIDs of ``dev`` port ``port`` with their types, or None without sysfs."""
    base = os.path.join(root, dev, "ports", str(port))
    gdir = os.path.join(base, "gids")
    try:
        names = os.listdir(gdir)
    except OSError:
        return None
    out: list[GidEntry] = []
    for name in sorted((n for n in names if n.isdigit()), key=int):
        try:
            with open(os.path.join(gdir, name)) as f:
                gid = gid_from_str(f.read())
        except (OSError, ValueError):
            continue
        if gid == ZERO_GID:
            continue
        gtype: str | None
        try:
            with open(os.path.join(base, "gid_attrs", "types", name)) as f:
                gtype = f.read().strip() or None
        except OSError:
            gtype = None
        out.append(GidEntry(int(name), gid, gtype))
    return out


def gid_index_override(env: Mapping[str, str] | None = None) -> int | None:
    """``AIORDMA_GID_INDEX`` as an int, None when unset; DeviceError when malformed."""
    env = os.environ if env is None else env
    text = env.get("AIORDMA_GID_INDEX", "").strip()
    if not text:
        return None
    try:
        idx = int(text)
    except ValueError:
        raise DeviceError(errno.EINVAL, f"AIORDMA_GID_INDEX={text!r} is not an integer") from None
    if idx < 0:
        raise DeviceError(errno.EINVAL, f"AIORDMA_GID_INDEX={idx} is negative")
    return idx


def _is_loopback_or_any(ip: str) -> bool:
    a = ipaddress.ip_address(ip)
    return a.is_loopback or a.is_unspecified


def select_gid_index(entries: list[GidEntry], ip: str, *, dev: str = "?", port: int = 1,
                     env: Mapping[str, str] | None = None) -> int:
    """The GID index for ``ip`` (RoCE): the IPv4-mapped (or IPv6) GID of that address.

    Preference: ``AIORDMA_GID_INDEX`` if set; a matching GID of type RoCE v2; a matching
    GID of unknown type; any matching GID. A loopback or wildcard address (the peer is
    on this host) takes the first RoCE v2 IPv4 GID, else the first IPv4 GID. Raises
    DeviceError naming the device, the port and the GIDs it has when nothing matches.
    """
    override = gid_index_override(env)
    if override is not None:
        return override
    try:
        want = gid_for_ip(ip)
    except ValueError:
        raise DeviceError(errno.EINVAL, f"{ip!r} is not an IP address") from None

    def rank(e: GidEntry) -> int:
        if e.gid_type == ROCE_V2:
            return 0
        if e.gid_type is None:
            return 1
        return 2

    matching = sorted((e for e in entries if e.gid == want), key=lambda e: (rank(e), e.index))
    if matching:
        return matching[0].index
    if _is_loopback_or_any(ip):
        v4 = sorted((e for e in entries if e.gid[:12] == _V4_MAPPED),
                    key=lambda e: (rank(e), e.index))
        if v4:
            return v4[0].index
    have = ", ".join(f"{e.index}={format_gid(e.gid)}" + (f" ({e.gid_type})" if e.gid_type else "")
                     for e in entries) or "none"
    raise DeviceError(
        errno.ENODEV,
        f"no GID on {dev} port {port} matches {ip}; GIDs: {have} "
        f"(use the address of the interface {dev} is bound to, or set AIORDMA_GID_INDEX)",
    )
