"""aiordma echo client: sends COUNT messages of each SIZE, verifies every echo.

    python examples/echo_client.py --host 127.0.0.1 --port 18515 --count 1000 --size 64
    python examples/echo_client.py --port 18515 --count 3 --size 0,64,1M,64M

Prints one summary line per size (round-trip latency median/p99/min) and exits
non-zero on any mismatch or error.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _common import parse_size, run

import aiordma


def pattern(size: int, seq: int) -> bytes:
    """Deterministic, position- and sequence-dependent bytes."""
    if size == 0:
        return b""
    block = bytes((seq * 131 + i * 7) & 0xFF for i in range(min(size, 4093)))
    reps = size // len(block) + 1
    return (block * reps)[:size]


async def main(args: argparse.Namespace) -> int:
    sizes = [parse_size(s) for s in args.size.split(",")]
    opts = {"provider": args.provider} if args.provider else {}
    ok = True
    try:
        ep = await aiordma.connect(args.host, args.port, timeout=args.timeout, **opts)
    except (OSError, aiordma.RDMAError) as exc:
        print(f"echo_client: cannot connect to {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    async with ep:
        for size in sizes:
            rtts = []
            for seq in range(args.count):
                msg = pattern(size, seq)
                t0 = time.perf_counter()
                await ep.send(msg)
                back = await ep.recv()
                rtts.append(time.perf_counter() - t0)
                if back != msg:
                    where = next((i for i, (a, b) in enumerate(zip(back, msg, strict=False)) if a != b),
                                 min(len(back), len(msg)))
                    print(f"echo_client: MISMATCH size={size} seq={seq}: got {len(back)} bytes, "
                          f"first difference at byte {where}", file=sys.stderr)
                    ok = False
                    break
            if rtts:
                us = sorted(r * 1e6 for r in rtts)
                p99 = us[min(len(us) - 1, int(len(us) * 0.99))]
                gbps = size * 2 * len(us) / sum(rtts) / 1e9 if size else 0.0
                print(f"echo {'ok' if ok else 'FAILED'}: provider={ep.provider} "
                      f"{len(us)} x {size} B round trips, rtt median "
                      f"{statistics.median(us):.1f} us p99 {p99:.1f} us min {us[0]:.1f} us, "
                      f"{gbps:.3f} GB/s", flush=True)
            if not ok:
                break
    return 0 if ok else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18515)
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--size", default="64", help="bytes, comma-separated; K/M suffixes")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--provider", choices=["soft", "verbs"], default=None)
    p.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto")
    a = p.parse_args()
    sys.exit(run(main(a), a.loop))
