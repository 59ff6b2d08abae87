"""Driving ``tests/net_peer.py`` processes: their JSON lines, with bounded waits; the
fixtures of the two-host tests (``net_fixture``/``server_fixture``: a module's
``NetPair``, a server on side a)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "net_peer.py")

#: figures the tests measured (how fast a fault was noticed, what moved): printed at the
#: end of the run by conftest's terminal summary, never asserted on
FIGURES: list[str] = []


def figure(line: str) -> None:
    """Report a measured figure (conftest prints them after the run)."""
    FIGURES.append(line)


class Peer:
    """A running ``net_peer.py``: its events (JSON lines) and signals."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.events: list[dict[str, Any]] = []
        self._buf = b""
        self._eof = False

    @classmethod
    def local(cls, *args: str, env: dict[str, str] | None = None) -> Peer:
        """``net_peer.py args`` on this host (soft provider)."""
        e = dict(os.environ if env is None else env, AIORDMA_PROVIDER="soft")
        return cls(subprocess.Popen([sys.executable, PEER, *args], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, env=e))

    def line(self, timeout: float) -> dict[str, Any] | None:
        """The next event within ``timeout`` s; None at EOF or on timeout. (Reads the
        pipe's descriptor itself: a buffered reader could hold lines ``select`` misses.)"""
        out = self.proc.stdout
        assert out is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf and not self._eof:
            r, _w, _x = select.select([out.fileno()], [], [],
                                      max(0.0, deadline - time.monotonic()))
            if not r:
                return None
            chunk = os.read(out.fileno(), 65536)
            self._eof = not chunk
            self._buf += chunk
        if b"\n" not in self._buf:
            return None
        raw, self._buf = self._buf.split(b"\n", 1)
        ev: dict[str, Any] = json.loads(raw)
        self.events.append(ev)
        return ev

    def until(self, pred: Callable[[dict[str, Any]], bool], timeout: float,
              what: str) -> dict[str, Any]:
        """Read events until one satisfies ``pred``; AssertionError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        for _ in range(10_000):  # bounded in count as in time
            left = deadline - time.monotonic()
            ev = self.line(left) if left > 0 else None
            if ev is None:
                raise AssertionError(f"no {what} within {timeout:g}s; events: {self.events}, "
                                     f"exit status {self.proc.poll()}")
            if pred(ev):
                return ev
        raise AssertionError(f"no {what} in 10000 events")

    def failures(self, names: set[str], timeout: float) -> dict[str, dict[str, Any]]:
        """Wait for a ``failed`` event of each endpoint in ``names``."""
        got = {e["ep"]: e for e in self.events if e.get("event") == "failed"}
        deadline = time.monotonic() + timeout
        for _ in range(1000):
            if names <= set(got):
                return got
            ev = self.until(lambda e: e.get("event") == "failed",
                            max(0.0, deadline - time.monotonic()),
                            f"failure of {sorted(names - set(got))}")
            got[ev["ep"]] = ev
        return got

    def command(self, cmd: str, answer: str, timeout: float) -> dict[str, Any]:
        """Send a ``hold`` command; its answer event."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.until(lambda e: e.get("event") == answer, timeout, f"answer to {cmd}")

    def drain(self, timeout: float) -> list[dict[str, Any]]:
        """Every event that comes within ``timeout`` s (at most 1000): what a peer said
        before a failure elsewhere, for the failure's message."""
        deadline = time.monotonic() + timeout
        for _ in range(1000):
            if self.line(max(0.0, deadline - time.monotonic())) is None:
                break
        return self.events

    def finish(self, timeout: float) -> dict[str, Any]:
        """Wait for the exit of a one-shot scenario: its last event (``ok``)."""
        ev = self.until(lambda e: "ok" in e, timeout, "the scenario's result")
        if not ev["ok"]:
            try:  # it exits; one that hangs dumps its threads' stacks (net_peer.py)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            raise AssertionError(f"the scenario failed: {ev}; exit status "
                                 f"{self.proc.poll()} (None: it hung on its way out)")
        self.proc.wait(timeout)
        assert self.proc.returncode == 0, f"exit status {self.proc.returncode}"
        return ev

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        """SIGSTOP, and wait (bounded) until every thread is stopped."""
        self.signal(signal.SIGSTOP)
        pid = self.proc.pid
        for _ in range(200):
            try:
                states = [open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0]
                          for t in os.listdir(f"/proc/{pid}/task")]
            except (FileNotFoundError, ProcessLookupError):
                return
            if all(s in "Tt" for s in states):
                return
            time.sleep(0.01)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.proc.kill()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass


# --- two hosts (aiordma/bench/netns.py) -----------------------------------------------------
SERVER_ADDR = "198.18.0.1"
PORT, STREAM_PORT, PROTO_PORT = 18515, 18516, 18517  # the namespaces' own ports


def soft_env() -> dict[str, str]:
    return dict(os.environ, AIORDMA_PROVIDER="soft")


def net_fixture() -> Any:
    """A module-scoped fixture: a ``NetPair`` (skips with the reason when none can be
    made here)."""

    @pytest.fixture(scope="module")
    def net() -> Iterator[Any]:
        from aiordma.bench.netns import NetPair, unavailable

        reason = unavailable()
        if reason is not None:
            pytest.skip(reason)
        with NetPair() as pair:
            yield pair

    return net


def start_server(net: Any, *args: str, timeout: float = 60.0) -> Peer:
    """``net_peer.py serve`` on side a, ready."""
    srv = Peer(net.python("a", [PEER, "serve", "--host", SERVER_ADDR, "--port", str(PORT),
                                "--stream-port", str(STREAM_PORT), "--proto-port",
                                str(PROTO_PORT), *args], env=soft_env()))
    srv.until(lambda e: e.get("ready", False), timeout, "the server")
    return srv


def server_fixture() -> Any:
    """A fixture: a server on side a of ``net``; every fault cleared afterwards."""

    @pytest.fixture
    def server(net: Any) -> Iterator[Peer]:
        srv = start_server(net)
        try:
            yield srv
        finally:
            srv.close()
            net.clear()

    return server


def client(net: Any, *args: str) -> Peer:
    """``net_peer.py args`` on side b, towards the server."""
    return Peer(net.python("b", [PEER, *args, "--host", SERVER_ADDR, "--port", str(PORT)],
                           env=soft_env()))


def api_works(net: Any, timeout: float = 60.0) -> None:
    """A new connection does the endpoint API (up to 1 MiB): the link works again."""
    c = client(net, "api", "--stream-port", str(STREAM_PORT), "--proto-port", str(PROTO_PORT),
               "--max-size", str(1 << 20))
    try:
        c.finish(timeout)
    finally:
        c.close()
