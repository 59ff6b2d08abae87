"""``aiordma doctor``: what this machine offers aiordma, and whether aiordma works here.

    python -m aiordma doctor [--provider soft|verbs] [--host ADDR] [--timeout S]

Reports, one finding a line, each tagged ``ok``, ``info``, ``warn`` or ``FAIL``:

* the aiordma version, build (``aiordma.native.build()``) and Python;
* every provider and whether it is available (``verbs`` needs pyverbs), with the reason
  when it is not;
* every device: its ports' state, link layer, active and maximum MTU in bytes, and
  the non-zero GIDs (an IPv4-mapped GID also as its address);
* the locked-memory limit (``RLIMIT_MEMLOCK``; the ``verbs`` provider pins every
  connection's buffer pools);
* whether one process may read another's memory (Yama ``ptrace_scope``, probed from a
  child process): the ``soft`` provider's cross-memory attach needs it, and copies
  through its socket without it;
* a loopback ping-pong on each provider that has an ACTIVE port: a listener and a
  client in this process exchange 64 B messages, then the client WRITEs, READs back
  and fetch-adds a region the listener registered, all within ``--timeout``.

The last line is the verdict. Exit status: 0 when every provider with an ACTIVE port
passed its loopback (warnings do not fail), 1 when one failed or no provider works,
2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import os
import platform
import resource
import subprocess
import sys
import time

import aiordma

from . import native, tcp_backoff
from .errors import ConnectionClosed, RDMAError
from .memory import RemoteBuffer
from .transport import Endpoint, connect, listen
from .verbs import PROVIDERS, DeviceInfo, PortState, get_provider, open_context

#: below this locked-memory limit the verbs provider is warned about (the default
#: options pin about 3 MiB of pools per connection, more with rendezvous staging)
MEMLOCK_WARN = 64 << 20
PING_ROUNDS = 100
PING_SIZE = 64
REGION_SIZE = 4096
YAMA = "/proc/sys/kernel/yama/ptrace_scope"


@dataclasses.dataclass
class Finding:
    """One line of the report: ``status`` is ``ok``, ``info``, ``warn`` or ``fail``."""

    status: str
    text: str

    def __str__(self) -> str:
        tag = {"ok": " ok ", "info": "info", "warn": "warn", "fail": "FAIL"}[self.status]
        return f"[{tag}] {self.text}"


def providers(only: str | None = None) -> tuple[list[Finding], list[str]]:
    """A finding per provider (``only`` that one), and the names of the available ones."""
    found, names = [], []
    for name in PROVIDERS:
        if only not in (None, name):
            continue
        try:
            get_provider(name).list_devices()
        except Exception as exc:
            reason = (exc.strerror or str(exc)) if isinstance(exc, RDMAError) else repr(exc)
            found.append(Finding("info", f"provider {name}: unavailable: {reason}"))
            continue
        names.append(name)
        found.append(Finding("ok", f"provider {name}: available"))
    return found, names


def gid_text(gid: bytes) -> str:
    """``gid`` as an IPv6 address; an IPv4-mapped one as ``::ffff:A.B.C.D (A.B.C.D)``
    (Python's own spelling of those changed in 3.13)."""
    addr = ipaddress.IPv6Address(gid)
    v4 = addr.ipv4_mapped
    return f"::ffff:{v4} ({v4})" if v4 else str(addr)


def device(info: DeviceInfo) -> tuple[list[Finding], str | None]:
    """Findings for one device, and the IPv4 address of its first IPv4-mapped GID on an
    ACTIVE port (where a loopback can listen), if any."""
    found: list[Finding] = []
    addr: str | None = None
    try:
        ctx = open_context(info.name, provider=info.provider)
    except Exception as exc:
        return [Finding("fail", f"device {info.name} ({info.provider}): cannot open: {exc}")], None
    try:
        for p in info.ports:
            pa = ctx.query_port(p.port_num)
            gids = [(i, g) for i in range(pa.gid_tbl_len)
                    if any(g := ctx.query_gid(p.port_num, i))]
            active = pa.state == PortState.ACTIVE
            found.append(Finding(
                "ok" if active else "warn",
                f"device {info.name} ({info.provider}) port {p.port_num}: {pa.state.name}, "
                f"link {pa.link_layer.name}, MTU {pa.active_mtu.bytes} (max "
                f"{pa.max_mtu.bytes}), lid {pa.lid}, GIDs: "
                + (", ".join(f"[{i}] {gid_text(g)}" for i, g in gids) or "none")))
            for _i, g in gids:
                v4 = ipaddress.IPv6Address(g).ipv4_mapped
                if active and v4 is not None and addr is None:
                    addr = str(v4)
    finally:
        ctx.close()
    return found, addr


def memlock(verbs_devices: bool) -> Finding:
    """The locked-memory limit; a warning when it is low and a verbs device exists."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    text = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"
    if soft == resource.RLIM_INFINITY or soft >= MEMLOCK_WARN or not verbs_devices:
        return Finding("ok" if verbs_devices else "info", f"memlock limit: {text}")
    return Finding("warn", f"memlock limit: {text}: the verbs provider pins every "
                           "connection's buffers; raise it (ulimit -l unlimited, or "
                           "LimitMEMLOCK= for a systemd service)")


def ptrace() -> Finding:
    """Whether an unrelated process of this user may read this one's memory, as the
    soft provider's cross-memory attach does: a child process opens the parent's
    ``/proc/PID/mem`` (the same ptrace check; a parent may always read its children)."""
    try:
        with open(YAMA) as f:
            scope = f"Yama ptrace_scope {f.read().strip()}"
    except OSError:
        scope = "no Yama ptrace_scope"
    probe = f"open('/proc/{os.getpid()}/mem', 'rb').close()"
    try:
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=30)
        allowed = r.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        allowed = False
    if os.environ.get("AIORDMA_SOFT_CMA") == "0":
        return Finding("info", f"cross-memory attach: off (AIORDMA_SOFT_CMA=0); {scope}")
    if allowed:
        return Finding("ok", f"cross-memory attach between processes: allowed ({scope})")
    return Finding("warn", f"cross-memory attach between processes: denied ({scope}): the "
                           "soft provider copies large transfers through its socket instead "
                           "(slower); sysctl kernel.yama.ptrace_scope=0 allows it (1 allows "
                           "it only towards child processes)")


def tcp_retransmissions() -> Finding:
    """Whether aiordma's TCP connections get their retransmission back-off capped."""
    if tcp_backoff.available():
        return Finding("info", f"TCP retransmission back-off: capped at "
                               f"{tcp_backoff.RTO_MAX_MS} ms on aiordma's connections")
    return Finding("info", "TCP retransmission back-off: the system's (the kernel refuses "
                           "TCP_RTO_MAX_MS, Linux 6.15+): on a lossy link soft's retries and "
                           "the heartbeat wait out TCP's doubling; raise ack_timeout and "
                           "liveness_timeout there")


async def _ping_pong(provider: str, dev: str, host: str) -> str:
    memory = bytearray(REGION_SIZE + 8)

    async def handler(ep: Endpoint) -> None:
        async with ep:
            region = ep.register(memory, remote_read=True, remote_write=True, remote_atomic=True)
            await ep.send(region.remote(0, REGION_SIZE).pack() + region.remote(REGION_SIZE, 8).pack())
            for _ in range(PING_ROUNDS):
                await ep.send(await ep.recv())
            try:
                await ep.recv()  # until the client closes
            except ConnectionClosed:
                pass

    async with await listen(handler, host, 0, provider=provider, device=dev) as listener:
        async with await connect(host, listener.port, provider=provider, device=dev) as ep:
            raw = await ep.recv()
            data, word = raw[:len(raw) // 2], raw[len(raw) // 2:]
            out, back = bytearray(os.urandom(REGION_SIZE)), bytearray(REGION_SIZE)
            ep.register(out)
            ep.register(back)
            times = []
            for _ in range(PING_ROUNDS):
                t0 = time.perf_counter()
                await ep.send(out[:PING_SIZE])
                if await ep.recv() != out[:PING_SIZE]:
                    raise AssertionError("an echoed message came back different")
                times.append(time.perf_counter() - t0)
            await ep.write(out, RemoteBuffer.unpack(data))
            await ep.read(back, RemoteBuffer.unpack(data))
            if back != out or await ep.fetch_add(RemoteBuffer.unpack(word), 1) != 0:
                raise AssertionError("a one-sided operation returned wrong data")
    times.sort()
    return (f"{PING_ROUNDS} round trips of {PING_SIZE} B, median "
            f"{times[len(times) // 2] * 1e6:.0f} us; WRITE, READ of {REGION_SIZE} B and "
            "fetch_add verified")


def loopback(provider: str, dev: str, host: str, timeout: float) -> Finding:
    """A ping-pong and one-sided operations between two endpoints of this process."""
    where = f"loopback {provider} ({dev}, {host})"
    try:
        detail = asyncio.run(asyncio.wait_for(_ping_pong(provider, dev, host), timeout))
    except TimeoutError:
        return Finding("fail", f"{where}: no answer within {timeout:g} s")
    except Exception as exc:
        return Finding("fail", f"{where}: {type(exc).__name__}: {exc}")
    return Finding("ok", f"{where}: {detail}")


def verdict(findings: list[Finding], working: list[str]) -> tuple[int, str]:
    """The exit status and the last line, from the findings."""
    failed = [f for f in findings if f.status == "fail"]
    warned = sum(f.status == "warn" for f in findings)
    if failed or not working:
        why = f"{len(failed)} check(s) failed" if failed else "no provider passed a loopback"
        return 1, f"verdict: FAIL: {why}"
    note = f", {warned} warning(s)" if warned else ""
    return 0, f"verdict: OK: aiordma works here on {', '.join(working)}{note}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiordma doctor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--provider", choices=sorted(PROVIDERS), default=None,
                   help="check this provider only")
    p.add_argument("--host", default=None, help="address for the verbs loopback (default: "
                   "the first IPv4 GID of an ACTIVE port)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per loopback")
    a = p.parse_args(argv)
    findings = [Finding("info", f"aiordma {aiordma.__version__} (build {native.build()}), Python "
                                f"{platform.python_version()}, {platform.system()} "
                                f"{platform.release()}")]
    found, available = providers(a.provider)
    findings += found
    working: list[str] = []
    targets: list[tuple[str, str, str | None]] = []
    for name in available:
        devs = get_provider(name).list_devices()
        if not devs:
            findings.append(Finding("info", f"provider {name}: no devices"))
        for d in devs:
            dev_findings, addr = device(d)
            findings += dev_findings
            if d.active:
                targets.append((name, d.name, "127.0.0.1" if name == "soft" else a.host or addr))
    findings.append(memlock(any(t[0] == "verbs" for t in targets)))
    findings.append(ptrace())
    findings.append(tcp_retransmissions())
    for name, dev, host in targets:
        if host is None:
            findings.append(Finding("warn", f"loopback {name} ({dev}): no IPv4 GID on an "
                                            "ACTIVE port; give --host ADDR"))
            continue
        findings.append(loopback(name, dev, host, a.timeout))
        if findings[-1].status == "ok" and name not in working:
            working.append(name)
    for f in findings:
        print(f, flush=True)
    code, last = verdict(findings, working)
    print(last)
    return code
