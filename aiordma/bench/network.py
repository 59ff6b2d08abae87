"""``python -m aiordma.bench.network``: soft across two hosts against plain TCP on the same
link, measured in the same run, under the faults of a real network.

Two network namespaces joined by a veth pair (``aiordma/bench/netns.py``; root, iproute2,
iptables), a bulk transfer from b to a for ``--seconds``: asyncio TCP (``write`` of
``--size`` chunks, ``drain``) and an aiordma endpoint on the ``soft`` provider
(``--size`` messages, ``--window`` in flight), alternating which goes first, over
``--rounds`` rounds, on each condition:

* ``clean``: the bare link;
* ``loss10``: 10% of the packets lost each way (dropped on arrival, one MTU each);
* ``reorder``: 10% of the packets each way arrive 3 ms late (behind later ones);
* ``delay``: 10 ms more each way, up to 2 ms of jitter.

For each it prints the medians (MiB/s), soft's ratio to TCP, the sender's TCP fast
retransmits and DSACKs received (a DSACK tells a retransmission was spurious), and
the tries of soft's local ACK timer that ended without progress. Then ``--pause``:
soft's transfer while the receiving process is stopped for that long (SIGSTOP), with
the default retry policy: whether the connection survived. ``--sweep 15,16,17,18``:
instead, soft alone with each ``ack_timeout`` (7 retries), ``--rounds`` runs on
``loss10`` and one with the pause: how many survived (how the default was chosen).
Nothing is asserted; every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from typing import Any

from .netns import ADDR, CMD_TIMEOUT_S, NetPair, _readline, unavailable

PORT = 18600
CONDITIONS: dict[str, dict[str, Any]] = {
    "clean": {},
    "loss10": {"loss": 0.10},
    "reorder": {"fraction": 0.10, "delay_ms": 3.0},
    "delay": {"delay_ms": 10.0, "jitter_ms": 2.0},
}
_COUNTERS = ("TcpExt.TCPFastRetrans", "TcpExt.TCPDSACKRecv", "Tcp.RetransSegs")


def _env() -> dict[str, str]:
    return dict(os.environ, AIORDMA_PROVIDER="soft")


def _run_one(net: NetPair, kind: str, seconds: float, size: int, window: int,
             pause: float = 0.0, ack_timeout: int | None = None) -> dict[str, Any]:
    srv = net.python("a", ["-m", "aiordma.bench.netpeer", "server", kind, ADDR["a"], str(PORT)],
                     env=_env())
    try:
        line = _readline(srv, 6 * CMD_TIMEOUT_S)
        if line.strip() != "READY":
            raise RuntimeError(f"{kind} server did not start: {line!r}")
        before = net.tcp_counters("b")
        cli = net.python("b", ["-m", "aiordma.bench.netpeer", "client", kind, ADDR["a"],
                               str(PORT), str(seconds), str(size), str(window),
                               *([] if ack_timeout is None else [str(ack_timeout)])],
                         env=_env())
        if pause:
            time.sleep(min(2.0, seconds / 4))
            os.kill(srv.pid, signal.SIGSTOP)
            time.sleep(pause)
            os.kill(srv.pid, signal.SIGCONT)
        out, _ = cli.communicate(timeout=seconds + 180)
        after = net.tcp_counters("b")
        res: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        for c in _COUNTERS:
            res[c] = after.get(c, 0) - before.get(c, 0)
        return res
    finally:
        if srv.poll() is None:
            os.kill(srv.pid, signal.SIGCONT)
            srv.kill()
        srv.wait(30)


def _apply(net: NetPair, spec: dict[str, Any]) -> None:
    spec = dict(spec)
    loss = spec.pop("loss", 0.0)
    if loss:
        net.loss(loss)
    if spec:
        net.netem("both", seed=3, **spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiordma.bench.network", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conditions", default=",".join(CONDITIONS))
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", type=int, default=1 << 20)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--pause", type=float, default=3.0, help="0: no pause test")
    p.add_argument("--sweep", default="", help="ack_timeout codes to compare (soft only)")
    a = p.parse_args(argv)
    reason = unavailable()
    if reason is not None:
        print(f"aiordma.bench.network: {reason}", file=sys.stderr)
        return 2
    if a.sweep:
        return _sweep(a, [int(x) for x in a.sweep.split(",")])
    conds = [c for c in a.conditions.split(",") if c]
    print(f"soft vs TCP between two network namespaces (veth, MTU 1500): {a.seconds:g} s "
          f"bulk b->a, {a.size} B writes/messages, soft window {a.window}, "
          f"{a.rounds} rounds, medians")
    print(f"{'condition':10s} {'TCP MiB/s':>10s} {'soft MiB/s':>11s} {'soft/TCP':>9s}  "
          f"{'fast rtx TCP/soft':>18s} {'DSACK TCP/soft':>15s} {'ACK-timer tries':>15s}  errors")
    with NetPair() as net:
        for cond in conds:
            runs: dict[str, list[dict[str, Any]]] = {"tcp": [], "rdma": []}
            for r in range(a.rounds):
                _apply(net, CONDITIONS[cond])
                for kind in (("tcp", "rdma") if r % 2 == 0 else ("rdma", "tcp")):
                    runs[kind].append(_run_one(net, kind, a.seconds, a.size, a.window))
                net.clear()

            def med(kind: str, key: str, runs: dict[str, list[dict[str, Any]]] = runs) -> float:
                return statistics.median(float(x[key] or 0) for x in runs[kind])

            tcp, soft = med("tcp", "mib_s"), med("rdma", "mib_s")
            errs = [x["error"] for k in runs for x in runs[k] if x["error"]]
            print(f"{cond:10s} {tcp:10.1f} {soft:11.1f} {soft / tcp if tcp else 0:9.2f}  "
                  f"{med('tcp', _COUNTERS[0]):8.0f}/{med('rdma', _COUNTERS[0]):<9.0f} "
                  f"{med('tcp', _COUNTERS[1]):7.0f}/{med('rdma', _COUNTERS[1]):<7.0f} "
                  f"{med('rdma', 'ack_timeouts'):15.0f}  {errs or ''}", flush=True)
        if a.pause:
            seconds = max(a.seconds, a.pause + 4.0)
            for kind in ("tcp", "rdma"):
                res = _run_one(net, kind, seconds, a.size, a.window, pause=a.pause)
                name = "TCP" if kind == "tcp" else "soft"
                print(f"receiver paused {a.pause:g} s during {seconds:g} s of {name} "
                      f"(default retry policy): "
                      f"{'survived' if res['error'] is None else 'FAILED: ' + res['error']}, "
                      f"{res['mib_s']:.1f} MiB/s over the run, ACK-timer tries "
                      f"{res['ack_timeouts']}", flush=True)
    return 0


def _sweep(a: argparse.Namespace, codes: list[int]) -> int:
    print(f"soft's retry policy: ack_timeout codes, 7 retries; {a.rounds} runs of "
          f"{a.seconds:g} s at 10% loss each way, one run with the receiver paused "
          f"{a.pause:g} s")
    print(f"{'ack_timeout':>11s} {'try s':>6s} {'budget s':>8s} {'loss10 survived':>16s} "
          f"{'MiB/s':>6s} {'tries':>6s} {'pause survived':>15s}")
    with NetPair() as net:
        for code in codes:
            net.loss(0.10)
            runs = [_run_one(net, "rdma", a.seconds, a.size, a.window, ack_timeout=code)
                    for _ in range(a.rounds)]
            net.clear()
            paused = _run_one(net, "rdma", max(a.seconds, a.pause + 4.0), a.size, a.window,
                              pause=a.pause, ack_timeout=code)
            try_s = 4.096e-6 * (1 << max(code, 15))
            ok = sum(r["error"] is None for r in runs)
            print(f"{code:11d} {try_s:6.2f} {8 * try_s:8.2f} {ok:>11d}/{len(runs):<4d} "
                  f"{statistics.median(r['mib_s'] for r in runs):6.2f} "
                  f"{sum(r['ack_timeouts'] or 0 for r in runs):6d} "
                  f"{'yes' if paused['error'] is None else 'no':>15s}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
