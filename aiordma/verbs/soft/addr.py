"""Addresses of the soft device: configuration, GID table entries, peer sockaddrs."""

from __future__ import annotations

import array
import fcntl
import ipaddress
import os
import socket
import struct
import sys

from ...errors import DeviceError

DEFAULT_ADDR = "127.0.0.1"
_V4_PREFIX = b"\0" * 10 + b"\xff\xff"


def unix_enabled() -> bool:
    """Same-host peers talk over an abstract Unix socket (Linux; ``AIORDMA_SOFT_UNIX=0``
    keeps TCP): no TCP/IP stack, no loopback checksums, larger segments."""
    return sys.platform.startswith("linux") and os.environ.get("AIORDMA_SOFT_UNIX", "1") != "0"


def unix_name(host: str, port: int) -> str:
    """The abstract Unix socket name of the device listening on ``host:port``. Abstract
    names live in the network namespace, as the addresses do, so a name found there
    is that device."""
    return f"\0aiordma-soft/{host}/{port}"


def unix_names_for(ip: str, port: int) -> list[str]:
    """Names to try, in order, to reach the device at ``ip:port`` on this host (a
    device bound to a wildcard address is reachable at every local address)."""
    wild = "::" if ":" in ip else "0.0.0.0"
    return [unix_name(ip, port), unix_name(wild, port)]


def configured() -> tuple[str, int]:
    """``(AIORDMA_SOFT_ADDR or 127.0.0.1, AIORDMA_SOFT_PORT or 0)``; DeviceError if invalid."""
    host = os.environ.get("AIORDMA_SOFT_ADDR") or DEFAULT_ADDR
    port_s = os.environ.get("AIORDMA_SOFT_PORT") or "0"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise DeviceError(f"AIORDMA_SOFT_ADDR={host!r} is not an IP address") from None
    try:
        port = int(port_s)
        if not 0 <= port <= 0xFFFF:
            raise ValueError
    except ValueError:
        raise DeviceError(f"AIORDMA_SOFT_PORT={port_s!r} is not a TCP port number") from None
    return host, port


def gid_of(ip: str) -> bytes:
    """The GID of an address: IPv4-mapped IPv6 for IPv4, the address itself for IPv6."""
    a = ipaddress.ip_address(ip)
    if isinstance(a, ipaddress.IPv4Address):
        return _V4_PREFIX + a.packed
    return a.packed


def gid_str(gid: bytes) -> str:
    """A GID as an address: dotted quad for IPv4-mapped GIDs."""
    if gid.startswith(_V4_PREFIX):
        return socket.inet_ntoa(gid[12:])
    return socket.inet_ntop(socket.AF_INET6, gid)


def sockaddr_of(gid: bytes, port: int) -> tuple[int, tuple[str, int]]:
    """``(family, sockaddr)`` to reach the device with GID ``gid`` listening on ``port``."""
    if len(gid) != 16:
        raise ValueError("a GID is 16 bytes")
    if gid.startswith(_V4_PREFIX):
        return socket.AF_INET, (socket.inet_ntoa(gid[12:]), port)
    if gid == b"\0" * 16:
        return socket.AF_INET, ("127.0.0.1", port)
    return socket.AF_INET6, (socket.inet_ntop(socket.AF_INET6, gid), port)


def is_local(ip: str) -> bool:
    """True for a loopback address or an IPv4 address of a local interface."""
    a = ipaddress.ip_address(ip)
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    return a.is_loopback or str(a) in local_ipv4_addresses()


def same_host(a: str, b: str) -> bool:
    """True when the addresses ``a`` and ``b`` are one host: equal (IPv4-mapped IPv6
    counts as its IPv4 address), or both of this machine."""
    x, y = ipaddress.ip_address(a), ipaddress.ip_address(b)
    x = x.ipv4_mapped or x if isinstance(x, ipaddress.IPv6Address) else x
    y = y.ipv4_mapped or y if isinstance(y, ipaddress.IPv6Address) else y
    return x == y or (is_local(a) and is_local(b))


def local_ipv4_addresses() -> list[str]:
    """IPv4 addresses of the local interfaces (127.0.0.1 first)."""
    out = ["127.0.0.1"]
    siocgifaddr = 0x8915
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:  # pragma: no cover
        names = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                req = struct.pack("256s", name.encode()[:15])
                res = fcntl.ioctl(s.fileno(), siocgifaddr, array.array("B", req).tobytes())
            except OSError:
                continue
            ip = socket.inet_ntoa(res[20:24])
            if ip not in out:
                out.append(ip)
    return out


def gid_table(host: str) -> list[bytes]:
    """GID table of a device listening on ``host`` (every local IPv4 for a wildcard)."""
    if host in ("0.0.0.0", ""):
        return [gid_of(ip) for ip in local_ipv4_addresses()]
    if host == "::":
        return [gid_of(ip) for ip in local_ipv4_addresses()] + [gid_of("::1")]
    return [gid_of(host)]
