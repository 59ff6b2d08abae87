"""Two hosts on one machine: two network namespaces joined by a veth pair, and the
faults of a real network between them (iproute2 and iptables; root).

``NetPair`` makes namespaces ``<prefix>a``/``<prefix>b`` with the private addresses
``198.18.0.1``/``198.18.0.2`` (RFC 2544's benchmarking range; each namespace has its
own, so concurrent pairs of other processes never clash) on the interfaces
``<prefix>a0``/``<prefix>b0``, segmentation offload off (a dropped or delayed packet
is one MTU of the wire, as on a real link). Faults act on what side ``"a"``, ``"b"``
or ``"both"`` sends, on its way in at the other side (a packet dropped or held on the
way out would be one its sender's TCP knows about, which no wire does):

* ``loss(p)``: iptables' ``statistic`` match drops a fraction ``p`` (1.0: everything);
* ``netem(...)``: a ``aiordma.bench.nfqueue`` consumer delays and reorders; a fraction is
  duplicated by iptables' ``TEE`` target (a copy sent straight after the original);
* ``link_down()``/``link_up()``: the veth pair's carrier;
* ``remove_host(side)``: the link deleted, every process of that namespace killed, the
  namespace deleted (``recreate()`` builds the pair again);
* ``clear()``: every fault removed.

Every command has a time limit (``CMD_TIMEOUT_S``); ``close()`` (also on exit of the
``with`` block, and at interpreter exit) kills what runs in the namespaces and deletes
them, whatever happened before. ``unavailable()`` says why none can be made here.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, Final

CMD_TIMEOUT_S: Final = 10.0
ADDR: Final = {"a": "198.18.0.1", "b": "198.18.0.2"}
PREFIX_LEN: Final = 30
_ROOT: Final = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_live: set[NetPair] = set()
_serial = itertools.count()


def unavailable() -> str | None:
    """Why two namespaces cannot be made here (not root, no iproute2 or iptables, no
    namespace support), or None."""
    if os.geteuid() != 0:
        return "needs root (ip netns, iptables)"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2, iptables: `make net-prereqs` installs them)"
    name = f"aiordma-probe-{os.getpid()}"
    try:
        r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True,
                           timeout=CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"ip netns add failed: {exc}"
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=CMD_TIMEOUT_S)
    return None


def _sh(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.returncode}")
    return r


class NetPair:
    """Two namespaces joined by a veth pair (module docstring). A context manager."""

    def __init__(self, prefix: str | None = None, *, mtu: int = 1500) -> None:
        self.prefix = prefix or f"ard{os.getpid() % 100000}{next(_serial) % 100}"
        if len(self.prefix) > 13:  # interface names: at most 15 characters
            raise ValueError("prefix too long")
        self.mtu = mtu
        self.ns = {"a": f"{self.prefix}a", "b": f"{self.prefix}b"}
        self.dev = {"a": f"{self.prefix}a0", "b": f"{self.prefix}b0"}
        self.addr = dict(ADDR)
        self._procs: list[subprocess.Popen[Any]] = []
        self._consumers: dict[str, subprocess.Popen[str]] = {}
        _live.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # --- lifecycle -------------------------------------------------------------------
    def _build(self) -> None:
        a, b = self.ns["a"], self.ns["b"]
        for ns in (a, b):
            if os.path.exists(f"/run/netns/{ns}"):
                self._delete_ns(ns)
            _sh(["ip", "netns", "add", ns])
        _sh(["ip", "link", "add", self.dev["a"], "netns", a, "mtu", str(self.mtu), "type",
             "veth", "peer", "name", self.dev["b"], "netns", b, "mtu", str(self.mtu)])
        for side in ("a", "b"):
            ns, dev = self.ns[side], self.dev[side]
            _sh(["ip", "-n", ns, "addr", "add", f"{self.addr[side]}/{PREFIX_LEN}", "dev", dev])
            # one MTU per packet at the hooks (no GSO super-packets), as on a wire
            _sh(["ip", "-n", ns, "link", "set", "dev", dev, "gso_max_segs", "1",
                 "gso_max_size", str(self.mtu)], check=False)
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            _sh(["ip", "-n", ns, "link", "set", dev, "up"])

    def recreate(self) -> None:
        """Build the pair again (after ``remove_host``): fresh namespaces, no faults."""
        self._stop_all()
        for ns in self.ns.values():
            self._delete_ns(ns)
        self._build()

    def close(self) -> None:
        """Kill every process started in the namespaces and delete them. Idempotent."""
        self._stop_all()
        for ns in self.ns.values():
            self._delete_ns(ns)
        _live.discard(self)

    def __enter__(self) -> NetPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stop_all(self) -> None:
        for side in list(self._consumers):
            self._stop_consumer(side)
        for p in self._procs:
            _kill(p)
        self._procs.clear()

    def _delete_ns(self, ns: str) -> None:
        if not os.path.exists(f"/run/netns/{ns}"):
            return
        self._kill_ns_pids(ns)
        _sh(["ip", "netns", "del", ns], check=False)

    @staticmethod
    def _kill_ns_pids(ns: str) -> None:
        r = _sh(["ip", "netns", "pids", ns], check=False)
        for pid in r.stdout.split():
            try:
                os.kill(int(pid), signal.SIGCONT)  # (a stopped process dies once resumed)
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    # --- processes -------------------------------------------------------------------
    def argv(self, side: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side], *argv]

    def spawn(self, side: str, argv: Sequence[str], env: dict[str, str] | None = None,
              **kw: Any) -> subprocess.Popen[str]:
        """Start ``argv`` in ``side``'s namespace (``ip netns exec`` execs it: the Popen's
        pid is the program's), with ``AIORDMA_SOFT_ADDR`` set to that side's address
        and this checkout on ``PYTHONPATH``. Killed by ``close()``."""
        e = dict(os.environ if env is None else env)
        e.setdefault("AIORDMA_SOFT_ADDR", self.addr[side])
        e["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, e.get("PYTHONPATH", "")) if p)
        kw.setdefault("stdin", subprocess.PIPE)
        kw.setdefault("stdout", subprocess.PIPE)
        p: subprocess.Popen[str] = subprocess.Popen(self.argv(side, argv), env=e, text=True,
                                                    **kw)
        self._procs.append(p)
        return p

    def python(self, side: str, args: Sequence[str], **kw: Any) -> subprocess.Popen[str]:
        """``spawn`` this interpreter with ``args``."""
        return self.spawn(side, [sys.executable, *args], **kw)

    # --- faults ----------------------------------------------------------------------
    def _sides(self, side: str) -> list[str]:
        return ["a", "b"] if side == "both" else [side]

    def iptables(self, side: str, *args: str) -> None:
        for s in self._sides(side):
            _sh(["ip", "netns", "exec", self.ns[s], "iptables", "-w", "5", *args])

    @staticmethod
    def _other(side: str) -> str:
        return "b" if side == "a" else "a"

    def loss(self, p: float, side: str = "both") -> None:
        """Drop a fraction ``p`` of the packets ``side`` sends (1.0: all), on arrival."""
        for s in self._sides(side):
            r = self._other(s)
            self.iptables(r, "-t", "raw", "-A", "PREROUTING", "-i", self.dev[r],
                          *_fraction(p), "-j", "DROP")

    def netem(self, side: str = "both", *, delay_ms: float = 0.0, jitter_ms: float = 0.0,
              reorder: float = 0.0, reorder_ms: float = 5.0, dup: float = 0.0,
              fraction: float = 1.0, seed: int | None = None) -> None:
        """Delay (``delay_ms`` plus up to ``jitter_ms``) and reorder (a fraction
        ``reorder`` held ``reorder_ms`` more) what ``side`` sends, through an NFQUEUE
        consumer where it arrives; duplicate a fraction ``dup``. ``fraction``: only
        that share of the packets goes through the consumer (the rest passes at once:
        with a delay, that share arrives late, out of order)."""
        for s in self._sides(side):
            if dup > 0:
                self.iptables(s, "-t", "mangle", "-A", "POSTROUTING", "-o", self.dev[s],
                              *_fraction(dup), "-j", "TEE", "--gateway",
                              self.addr[self._other(s)])
            if not (delay_ms or jitter_ms or reorder):
                continue
            r = self._other(s)
            if r in self._consumers:
                raise RuntimeError(f"side {r} already has a netem consumer")
            args = ["-m", "aiordma.bench.nfqueue", "--queue", "0", "--delay-ms", str(delay_ms),
                    "--jitter-ms", str(jitter_ms), "--reorder", str(reorder),
                    "--reorder-ms", str(reorder_ms)]
            if seed is not None:
                args += ["--seed", str(seed + ord(s))]
            p = subprocess.Popen(self.argv(r, [sys.executable, *args]), text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env=dict(os.environ, PYTHONPATH=_ROOT), cwd=_ROOT)
            self._consumers[r] = p
            line = _readline(p, CMD_TIMEOUT_S)
            if line.strip() != "READY":
                err = p.stderr.read() if p.poll() is not None and p.stderr else ""
                raise RuntimeError(f"nfqueue consumer did not start: {line!r} {err}")
            self.iptables(r, "-t", "mangle", "-A", "PREROUTING", "-i", self.dev[r],
                          *_fraction(fraction), "-j", "NFQUEUE", "--queue-num", "0",
                          "--queue-bypass")

    def _stop_consumer(self, side: str) -> dict[str, Any] | None:
        p = self._consumers.pop(side, None)
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            out, _err = p.communicate(timeout=CMD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill(p)
            return None
        lines = [x for x in out.splitlines() if x.startswith("{")]
        return json.loads(lines[-1]) if lines else None

    def clear(self) -> dict[str, dict[str, Any] | None]:
        """Remove every fault (iptables rules, netem consumers, link state): the
        consumers' counters by the side they ran on."""
        for s in ("a", "b"):
            for table in ("raw", "mangle", "filter"):
                self.iptables(s, "-t", table, "-F")
        stats = {s: self._stop_consumer(s) for s in list(self._consumers)}
        self.link_up()
        return stats

    def link_down(self) -> None:
        _sh(["ip", "-n", self.ns["a"], "link", "set", self.dev["a"], "down"])

    def link_up(self) -> None:
        """Carrier back on both ends (waited for, at most ``CMD_TIMEOUT_S``), and the
        neighbour entries that failed while it was down forgotten (a FAILED entry
        answers EHOSTUNREACH until it ages out)."""
        for s in ("a", "b"):
            _sh(["ip", "-n", self.ns[s], "link", "set", self.dev[s], "up"], check=False)
        deadline = time.monotonic() + CMD_TIMEOUT_S
        while time.monotonic() < deadline:
            states = [_sh(["ip", "-n", self.ns[s], "link", "show", self.dev[s]],
                          check=False).stdout for s in ("a", "b")]
            if all("LOWER_UP" in st for st in states):
                break
            time.sleep(0.05)
        for s in ("a", "b"):
            _sh(["ip", "-n", self.ns[s], "neigh", "flush", "dev", self.dev[s]], check=False)

    def remove_host(self, side: str) -> None:
        """The host of ``side`` vanishes: its link first (so nothing it sends while
        dying reaches the other side), then its processes, then its namespace."""
        ns = self.ns[side]
        _sh(["ip", "-n", ns, "link", "del", self.dev[side]], check=False)
        self._kill_ns_pids(ns)
        _sh(["ip", "netns", "del", ns], check=False)

    def tcp_counters(self, side: str) -> dict[str, int]:
        """The kernel's TCP counters of ``side``'s namespace (``/proc/net/netstat`` and
        ``/proc/net/snmp``): ``{"TcpExt.TCPFastRetrans": n, ...}``."""
        out: dict[str, int] = {}
        for path in ("/proc/net/snmp", "/proc/net/netstat"):
            r = _sh(["ip", "netns", "exec", self.ns[side], "cat", path], check=False)
            lines = r.stdout.splitlines()
            for head, vals in zip(lines[::2], lines[1::2], strict=False):
                names, values = head.split(), vals.split()
                if not names or names[0] != values[0]:
                    continue
                group = names[0].rstrip(":")
                for n, v in zip(names[1:], values[1:], strict=False):
                    try:
                        out[f"{group}.{n}"] = int(v)
                    except ValueError:
                        pass
        return out


def _fraction(p: float) -> list[str]:
    """The iptables match of a random fraction ``p`` of the packets (none for 1.0)."""
    if p >= 1.0:
        return []
    return ["-m", "statistic", "--mode", "random", "--probability", f"{p:.6f}"]


def _readline(p: subprocess.Popen[str], timeout: float) -> str:
    """One line of ``p``'s stdout within ``timeout`` ('' if none)."""
    assert p.stdout is not None
    r, _w, _x = select.select([p.stdout], [], [], timeout)
    return p.stdout.readline() if r else ""


def _kill(p: subprocess.Popen[Any]) -> None:
    if p.poll() is None:
        try:
            p.send_signal(signal.SIGCONT)
            p.kill()
        except ProcessLookupError:
            pass
    try:
        p.wait(CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    for f in (p.stdin, p.stdout, p.stderr):
        if f is not None:
            try:
                f.close()
            except OSError:
                pass


@atexit.register
def _cleanup() -> None:
    for pair in list(_live):
        with contextlib.suppress(Exception):  # at exit: delete what can be deleted
            pair.close()
