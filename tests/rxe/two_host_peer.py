"""The far host of the two-guest tier (tests/test_rxe_two_hosts.py), run in guest A by
tests/rxe/run-two-vms.sh: a control server that the tests in guest B drive.

    python3 tests/rxe/two_host_peer.py --host 10.77.0.1 --port 7470 --lifetime 1200

It listens on plain TCP at ``--host:--port``; each request is one JSON object on a line
and gets one JSON object on a line back (``{"ok": false, "error": ...}`` on failure):

* ``{"cmd": "info"}``: this host's RDMA facts as the device reports them: ``addr``,
  ``device``, ``netdev``, ``netdev_mtu`` (bytes), ``active_mtu`` (the port's, bytes),
  ``gids`` (``{index: "gid"}`` from sysfs, non-zero entries only).
* ``{"cmd": "serve", "name": N, "port": P, "env": {...}, "args": [...]}``: start
  ``tests/net_peer.py serve --host HOST --port P ARGS`` with ``env`` added to this
  process's environment, and answer once it is listening (``pid``).
* ``{"cmd": "bench_server", "name": N, "kind": "tcp"|"rdma", "port": P}``: start
  ``python3 -m aiordma.bench.netpeer server KIND HOST P`` (a sink for a bulk transfer
  over plain TCP or an aiordma endpoint) and answer once it is listening.
* ``{"cmd": "events", "name": N}``: the JSON lines that server printed so far.
* ``{"cmd": "kill", "name": N}``: SIGKILL it and reap it; ``t`` is time.monotonic()
  just before the signal.
* ``{"cmd": "add_addr", "cidr": "10.78.0.1/24", "arp_ignore": 2}``: add that address to
  the RDMA device's netdev and answer with ``gid_index``, the index of the IPv4 GID the
  kernel gives it (waited for: rxe adds it from the address notifier). ``arp_ignore``
  (optional) sets the netdev's ``net.ipv4.conf.<netdev>.arp_ignore`` first (2: answer
  ARP only for a local address of the requester's subnet).
* ``{"cmd": "quit"}``: kill every server, answer, exit 0.

Every wait is bounded; the process exits by itself after ``--lifetime`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import aiordma  # noqa: E402

DEVICE = os.environ.get("AIORDMA_RXE_DEVICE", "rxe0")
NETDEV = os.environ.get("AIORDMA_RXE_NETDEV", "")
READY_TIMEOUT = 180.0  # a server process's start, imports included (emulated guest)


def sysfs_gids() -> dict[int, str]:
    """The non-zero GIDs of port 1 of ``DEVICE`` by index, as sysfs spells them."""
    base = f"/sys/class/infiniband/{DEVICE}/ports/1/gids"
    out: dict[int, str] = {}
    for name in os.listdir(base):
        try:
            with open(os.path.join(base, name)) as f:
                gid = f.read().strip()
        except OSError:  # an unused entry reads as EINVAL on newer kernels
            continue
        if gid.replace("0", "").replace(":", ""):
            out[int(name)] = gid
    return out


def mapped_gid(ip: str) -> str:
    """The IPv4-mapped GID of ``ip`` as sysfs spells it."""
    a, b, c, d = (int(x) for x in ip.split("."))
    return f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"


def info(host: str) -> dict[str, Any]:
    with open(f"/sys/class/net/{NETDEV}/mtu") as f:
        netdev_mtu = int(f.read())
    dev = aiordma.open_device(DEVICE, provider="verbs")
    try:
        active = dev.ctx.query_port(1).active_mtu.bytes
    finally:
        dev.close()
    return {"addr": host, "device": DEVICE, "netdev": NETDEV, "netdev_mtu": netdev_mtu,
            "active_mtu": active, "gids": sysfs_gids()}


class Server:
    """One server process (``argv``), started and waited for until it prints its
    readiness line (``ready_line``: the stripped line, or ``None`` for ``net_peer.py``'s
    ``{"ready": true}``); the JSON lines it printed."""

    def __init__(self, argv: list[str], env: dict[str, str], ready_line: str | None) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **env}, stdin=subprocess.DEVNULL)
        self.lines: list[dict[str, Any]] = []
        self.ready = threading.Event()
        self._ready_line = ready_line
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(READY_TIMEOUT) or self.proc.poll() is not None:
            self.kill()
            raise RuntimeError(f"{' '.join(argv[1:])}: not ready after {READY_TIMEOUT:g} s "
                               f"or exited (status {self.proc.poll()})")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if self._ready_line is not None and line.strip() == self._ready_line:
                self.ready.set()
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                self.lines.append(obj)
                if self._ready_line is None and obj.get("ready"):
                    self.ready.set()
        self.ready.set()  # it ended (before listening, maybe): stop waiting for it

    def kill(self) -> float:
        t = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        return t


def add_addr(cidr: str, arp_ignore: int | None) -> dict[str, Any]:
    if arp_ignore is not None:
        with open(f"/proc/sys/net/ipv4/conf/{NETDEV}/arp_ignore", "w") as f:
            f.write(f"{int(arp_ignore)}\n")
    subprocess.run(["ip", "addr", "add", cidr, "dev", NETDEV], check=True, timeout=30)
    want = mapped_gid(cidr.split("/")[0])
    deadline = time.monotonic() + 30
    for _ in range(600):  # the GID appears from rxe's address notifier
        for index, gid in sysfs_gids().items():
            if gid == want:
                return {"gid_index": index}
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    raise RuntimeError(f"no GID {want} on {DEVICE} 30 s after adding {cidr}")


def handle(req: dict[str, Any], host: str, servers: dict[str, Server]) -> dict[str, Any]:
    cmd = req.get("cmd")
    if cmd == "info":
        return info(host)
    if cmd == "serve":
        argv = [sys.executable, os.path.join(ROOT, "tests", "net_peer.py"), "serve",
                "--host", host, "--port", str(int(req["port"])),
                *(str(a) for a in req.get("args", []))]
        server = servers[str(req["name"])] = Server(argv, dict(req.get("env", {})), None)
        return {"pid": server.proc.pid}
    if cmd == "bench_server":
        kind = str(req["kind"])
        if kind not in ("tcp", "rdma"):
            raise ValueError(f"kind must be tcp or rdma, not {kind!r}")
        argv = [sys.executable, "-m", "aiordma.bench.netpeer", "server", kind, host,
                str(int(req["port"]))]
        server = servers[str(req["name"])] = Server(argv, {}, "READY")
        return {"pid": server.proc.pid}
    if cmd == "events":
        return {"events": list(servers[str(req["name"])].lines)}
    if cmd == "kill":
        return {"t": servers.pop(str(req["name"])).kill()}
    if cmd == "add_addr":
        arp = req.get("arp_ignore")
        return add_addr(str(req["cidr"]), None if arp is None else int(arp))
    if cmd == "quit":
        for s in servers.values():
            s.kill()
        servers.clear()
        return {"quit": True}
    raise ValueError(f"unknown command {cmd!r}")


def serve_client(conn: socket.socket, host: str, servers: dict[str, Server],
                 deadline: float) -> bool:
    """Answer one control connection's requests; True once it asked to quit."""
    with conn, conn.makefile("rwb") as f:
        for _ in range(100_000):
            conn.settimeout(max(1.0, deadline - time.monotonic()))
            line = f.readline()
            if not line:
                return False
            try:
                req = json.loads(line)
                reply = {"ok": True, **handle(req, host, servers)}
            except Exception as exc:  # reported to the client, which fails its test
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            f.write(json.dumps(reply).encode() + b"\n")
            f.flush()
            print("two_host_peer:", json.dumps(req)[:200], "->", json.dumps(reply)[:300],
                  flush=True)
            if reply.get("quit"):
                return True
    return False


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--lifetime", type=float, default=1200.0)
    a = p.parse_args()
    deadline = time.monotonic() + a.lifetime
    servers: dict[str, Server] = {}
    lsock = socket.create_server((a.host, a.port))
    print(f"two_host_peer: listening on {a.host}:{a.port}; {info(a.host)}", flush=True)
    try:
        for _ in range(1000):  # control connections; the tests open a few
            lsock.settimeout(max(1.0, deadline - time.monotonic()))
            try:
                conn, _addr = lsock.accept()
            except TimeoutError:
                sys.exit(f"two_host_peer: no quit within --lifetime {a.lifetime:g} s")
            if serve_client(conn, a.host, servers, deadline):
                return
    finally:
        for s in servers.values():
            s.kill()


if __name__ == "__main__":
    main()
