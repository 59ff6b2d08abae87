"""A netfilter queue consumer that delays and reorders packets (the kernel may have no
``tc netem``), in pure Python over ``NETLINK_NETFILTER``.

    python -m aiordma.bench.nfqueue --queue N [--delay-ms D] [--jitter-ms J]
        [--reorder P --reorder-ms R] [--seed S]

Run it in the network namespace whose iptables rule sends packets to queue ``N`` --
on arrival (``iptables -t mangle -A PREROUTING -i DEV -j NFQUEUE --queue-num N``, see
``aiordma/bench/netns.py``), where holding a packet costs its sender nothing (held on the
way out, it would count against the sending socket's small-queue budget, which no
wire does). Every packet is accepted after ``D`` ms plus a uniform ``0..J`` ms (jitter
reorders too); with probability ``P`` (``--reorder``) a packet is held ``R`` ms more
while the ones behind it pass. It prints ``READY`` once bound, then serves until
SIGTERM/SIGINT, and prints its counters as one JSON line on exit. Nothing here
imports aiordma.

Protocol (linux/netfilter/nfnetlink_queue.h): messages of subsystem
``NFNL_SUBSYS_QUEUE`` (3): CONFIG (bind a queue, copy mode), PACKET (kernel -> us:
packet id and payload), VERDICT (us -> kernel: accept or drop id).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from typing import Final

NETLINK_NETFILTER: Final = 12
NFNL_SUBSYS_QUEUE: Final = 3
NFQNL_MSG_PACKET: Final = 0
NFQNL_MSG_VERDICT: Final = 1
NFQNL_MSG_CONFIG: Final = 2
NFQA_CFG_CMD: Final = 1
NFQA_CFG_PARAMS: Final = 2
NFQA_CFG_QUEUE_MAXLEN: Final = 3
NFQA_PACKET_HDR: Final = 1
NFQA_VERDICT_HDR: Final = 2
NFQA_PAYLOAD: Final = 10
NFQNL_CFG_CMD_BIND: Final = 1
NFQNL_COPY_META: Final = 1
NF_ACCEPT: Final = 1
NLM_F_REQUEST: Final = 1
NLM_F_ACK: Final = 4
NLMSG_ERROR: Final = 2

_NLMSG: Final = struct.Struct("=IHHII")
_NFGEN: Final = struct.Struct("=BBH")  # family, version, res_id (big-endian, packed below)
_NLA: Final = struct.Struct("=HH")


def _attr(kind: int, payload: bytes) -> bytes:
    n = _NLA.size + len(payload)
    return _NLA.pack(n, kind) + payload + b"\0" * (-n % 4)


def _message(msg_type: int, queue: int, attrs: bytes, seq: int, flags: int = NLM_F_REQUEST) -> bytes:
    body = _NFGEN.pack(socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return _NLMSG.pack(_NLMSG.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg_type, flags,
                       seq, 0) + body


def _attrs(data: memoryview) -> dict[int, memoryview]:
    out: dict[int, memoryview] = {}
    pos = 0
    while pos + _NLA.size <= len(data):
        n, kind = _NLA.unpack_from(data, pos)
        if n < _NLA.size:
            break
        out[kind & 0x7FFF] = data[pos + _NLA.size:pos + n]
        pos += n + (-n % 4)
    return out


class Queue:
    """One bound netfilter queue (packet metadata only): ``packets()``, ``accept``."""

    def __init__(self, queue: int, maxlen: int = 4096) -> None:
        self.queue = queue
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind((0, 0))
        self._seq = 0
        cmd = struct.pack("!BxH", NFQNL_CFG_CMD_BIND, socket.AF_INET)
        self._config(_attr(NFQA_CFG_CMD, cmd))
        self._config(_attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
                     + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen)))

    def _config(self, attrs: bytes) -> None:
        self._seq += 1
        self.sock.send(_message(NFQNL_MSG_CONFIG, self.queue, attrs, self._seq,
                                NLM_F_REQUEST | NLM_F_ACK))
        data = self.sock.recv(65536)
        _n, kind, _f, _s, _p = _NLMSG.unpack_from(data, 0)
        if kind == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, _NLMSG.size)
            if err:
                raise OSError(-err, f"nfqueue config: {os.strerror(-err)}")

    def fileno(self) -> int:
        return self.sock.fileno()

    def packets(self) -> list[tuple[int, bytes]]:
        """The packets queued now (non-blocking): ``(packet id, payload)`` (the payload
        is empty: the queue copies metadata only)."""
        out: list[tuple[int, bytes]] = []
        while True:
            try:
                data = memoryview(self.sock.recv(1 << 17, socket.MSG_DONTWAIT))
            except (BlockingIOError, InterruptedError):
                return out
            except OSError as exc:  # ENOBUFS: the kernel dropped some of our messages
                if exc.errno == 105:
                    continue
                raise
            pos = 0
            while pos + _NLMSG.size <= len(data):
                n, kind, _f, _s, _p = _NLMSG.unpack_from(data, pos)
                if n < _NLMSG.size:
                    break
                if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                    attrs = _attrs(data[pos + _NLMSG.size + _NFGEN.size:pos + n])
                    hdr = attrs.get(NFQA_PACKET_HDR)
                    if hdr is not None:
                        (pid,) = struct.unpack_from("!I", hdr, 0)
                        out.append((pid, bytes(attrs.get(NFQA_PAYLOAD, b""))))
                pos += n + (-n % 4)

    def accept(self, packet_id: int) -> None:
        self._seq += 1
        self.sock.send(_message(NFQNL_MSG_VERDICT, self.queue,
                                _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id)),
                                self._seq))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiordma.bench.nfqueue", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queue", type=int, required=True)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--reorder", type=float, default=0.0)
    p.add_argument("--reorder-ms", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=None)
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    q = Queue(a.queue)
    stop = False

    def on_signal(_sig: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    held: list[tuple[float, int, int]] = []  # (release time, seq, packet id)
    seq = 0
    stats = {"packets": 0, "reordered": 0}
    print("READY", flush=True)
    while not stop:
        now = time.monotonic()
        while held and held[0][0] <= now:
            _t, _s, pid = heapq.heappop(held)
            q.accept(pid)
        timeout = max(0.0, held[0][0] - now) if held else 0.5
        try:
            ready, _w, _x = select.select([q], [], [], timeout)
        except InterruptedError:
            continue
        if not ready:
            continue
        now = time.monotonic()
        for pid, _pkt in q.packets():
            stats["packets"] += 1
            delay = a.delay_ms + (rng.uniform(0, a.jitter_ms) if a.jitter_ms else 0.0)
            if a.reorder and rng.random() < a.reorder:
                delay += a.reorder_ms
                stats["reordered"] += 1
            if delay <= 0:
                q.accept(pid)
            else:
                seq += 1
                heapq.heappush(held, (now + delay / 1e3, seq, pid))
    for _t, _s, pid in held:
        q.accept(pid)
    print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
