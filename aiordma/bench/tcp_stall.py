"""``python -m aiordma.bench.tcp_stall``: the longest wait for an answer over TCP on a lossy
link, with TCP's retransmission back-off as the system has it and capped
(``aiordma/tcp_backoff.py``), measured in the same run.

Two network namespaces (``aiordma/bench/netns.py``; root, iproute2, iptables), ``--loss``
of the packets dropped each way. Side b opens ``--conns`` TCP connections to side a and
keeps ``--window`` messages of 64 KiB in flight on each for ``--seconds``; side a answers
each whole message with 8 bytes (as a soft responder acknowledges a request). Printed
per setting: each connection's longest wait, with work outstanding, between two answers
(what a soft QP's retry budget, 8.6 s by default, and the heartbeat, 8 s, count), and
the answers it got. Nothing is asserted; every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import sys
import time
from typing import Any

from ..tcp_backoff import cap_backoff
from .netns import ADDR, CMD_TIMEOUT_S, NetPair, _readline, unavailable

PORT = 18700
MSG = 65536
ANSWER = 8


def _tune(sock: socket.socket, capped: bool) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if capped and not cap_backoff(sock):
        raise SystemExit("this kernel does not cap TCP's back-off (TCP_RTO_MAX_MS)")


def serve(capped: bool, seconds: float) -> None:
    """Side a: answer every whole message on every connection, for ``seconds`` at most."""
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((ADDR["a"], PORT))
    ls.listen()
    sel = selectors.DefaultSelector()
    sel.register(ls, selectors.EVENT_READ)
    got: dict[socket.socket, int] = {}
    print("READY", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for key, _ in sel.select(0.5):
            if key.fileobj is ls:
                c, _ = ls.accept()
                _tune(c, capped)
                sel.register(c, selectors.EVENT_READ)
                got[c] = 0
                continue
            c = key.fileobj  # type: ignore[assignment]
            try:
                data = c.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                sel.unregister(c)
                c.close()
                continue
            got[c] += len(data)
            whole, got[c] = divmod(got[c], MSG)
            c.sendall(b"A" * (ANSWER * whole))


def drive(capped: bool, seconds: float, conns: int, window: int) -> list[dict[str, Any]]:
    """Side b: the longest wait between answers with a message outstanding, per
    connection."""
    socks = []
    for _ in range(conns):
        c = socket.create_connection((ADDR["a"], PORT), timeout=CMD_TIMEOUT_S)
        _tune(c, capped)
        c.setblocking(False)
        socks.append(c)
    sel = selectors.DefaultSelector()
    st: dict[socket.socket, dict[str, Any]] = {}
    for c in socks:
        st[c] = {"out": 0, "last": time.monotonic(), "gap": 0.0, "answers": 0, "pend": b"",
                 "bytes": 0}
        sel.register(c, selectors.EVENT_READ | selectors.EVENT_WRITE)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for key, ev in sel.select(0.05):
            c = key.fileobj  # type: ignore[assignment]
            s = st[c]
            if ev & selectors.EVENT_READ:
                s["bytes"] += len(c.recv(4096))
                n, s["bytes"] = divmod(s["bytes"], ANSWER)
                if n:
                    now = time.monotonic()
                    s["gap"] = max(s["gap"], now - s["last"])
                    s["last"], s["out"], s["answers"] = now, s["out"] - n, s["answers"] + n
            if ev & selectors.EVENT_WRITE:
                if not s["pend"] and s["out"] < window:
                    if s["out"] == 0:
                        s["last"] = time.monotonic()
                    s["pend"], s["out"] = b"x" * MSG, s["out"] + 1
                if s["pend"]:
                    try:
                        s["pend"] = s["pend"][c.send(s["pend"]):]
                    except BlockingIOError:
                        pass
        now = time.monotonic()
        for s in st.values():
            if s["out"]:
                s["gap"] = max(s["gap"], now - s["last"])
    for c in socks:
        c.close()
    return [{"longest_wait_s": round(s["gap"], 2), "answers": s["answers"]} for s in st.values()]


def measure(args: argparse.Namespace) -> None:
    why = unavailable()
    if why:
        raise SystemExit(f"tcp_stall: {why}")
    for capped in (False, True):
        with NetPair() as net:
            net.loss(args.loss)
            flag = ["--capped"] if capped else []
            srv = net.python("a", ["-m", "aiordma.bench.tcp_stall", "--role", "serve", *flag,
                                   "--seconds", str(args.seconds + 30)])
            if _readline(srv, CMD_TIMEOUT_S).strip() != "READY":
                raise SystemExit("tcp_stall: the answering side did not start")
            cl = net.python("b", ["-m", "aiordma.bench.tcp_stall", "--role", "drive", *flag,
                                  "--seconds", str(args.seconds), "--conns", str(args.conns), "--window", str(args.window)])
            out, _ = cl.communicate(timeout=args.seconds + 60)
            rows = json.loads(out.strip().splitlines()[-1])
            waits = [r["longest_wait_s"] for r in rows]
            print(f"back-off {'capped at 1 s' if capped else 'uncapped'}: longest wait "
                  f"{max(waits):.2f} s (per connection {waits}), answers "
                  f"{[r['answers'] for r in rows]}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m aiordma.bench.tcp_stall",
                                 description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--role", choices=("measure", "serve", "drive"), default="measure",
                    help=argparse.SUPPRESS)
    ap.add_argument("--capped", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--loss", type=float, default=0.10, help="fraction lost each way")
    ap.add_argument("--seconds", type=float, default=60.0, help="traffic per setting")
    ap.add_argument("--conns", type=int, default=3)
    ap.add_argument("--window", type=int, default=8, help="64 KiB messages in flight")
    args = ap.parse_args(argv)
    if args.role == "serve":
        serve(args.capped, args.seconds)
    elif args.role == "drive":
        print(json.dumps(drive(args.capped, args.seconds, args.conns, args.window)), flush=True)
    else:
        measure(args)


if __name__ == "__main__":
    main(sys.argv[1:])
