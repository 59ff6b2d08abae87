"""One-sided RDMA between two processes: WRITE, READ, fetch-and-add, compare-and-swap.

    python examples/rdma_read_write.py                 # starts the target itself
    python examples/rdma_read_write.py --role target --port 18516
    python examples/rdma_read_write.py --role initiator --host H --port 18516

The target registers a region for remote read/write/atomics, sends its descriptor, and
then only waits: the initiator's operations complete without the target's code doing
anything (the device serves them). The initiator verifies every result and exits
non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time

from _common import parse_size, run

import aiordma


async def target(args: argparse.Namespace) -> int:
    size = parse_size(args.size)
    memory = bytearray(size + 8)
    finished = asyncio.Event()

    async def handler(ep: aiordma.Endpoint) -> None:
        region = ep.register(memory, remote_read=True, remote_write=True, remote_atomic=True)
        await ep.send(region.remote(0, size).pack() + region.remote(size, 8).pack())
        try:
            await ep.recv()  # the initiator's "done" (or its close)
        except aiordma.ConnectionClosed:
            pass
        finished.set()

    opts = {"provider": args.provider} if args.provider else {}
    listener = await aiordma.listen(handler, args.host, args.port, **opts)
    print(f"listening on {args.host}:{listener.port}", flush=True)
    async with listener:
        await asyncio.wait_for(finished.wait(), args.timeout)
    return 0


async def initiator(args: argparse.Namespace) -> int:
    size = parse_size(args.size)
    opts = {"provider": args.provider} if args.provider else {}
    ep = await aiordma.connect(args.host, args.port, timeout=args.timeout, **opts)
    async with ep:
        raw = await ep.recv()
        data_desc = aiordma.RemoteBuffer.unpack(raw[:20])
        word_desc = aiordma.RemoteBuffer.unpack(raw[20:])
        out = bytearray(os.urandom(size))
        back = bytearray(size)
        ep.register(out)
        ep.register(back)
        t0 = time.perf_counter()
        await ep.write(out, data_desc)
        t1 = time.perf_counter()
        await ep.read(back, data_desc)
        t2 = time.perf_counter()
        if back != out:
            print("rdma_read_write: READ after WRITE returned different bytes", file=sys.stderr)
            return 1
        olds = await asyncio.gather(*(ep.fetch_add(word_desc, 1) for _ in range(100)))
        if sorted(olds) != list(range(100)):
            print(f"rdma_read_write: fetch_add results wrong: {sorted(olds)[:5]}...", file=sys.stderr)
            return 1
        if await ep.compare_swap(word_desc, 100, 7) != 100 or await ep.compare_swap(word_desc, 100, 9) != 7:
            print("rdma_read_write: compare_swap wrong", file=sys.stderr)
            return 1
        await ep.send(b"done")
        mb = size / 1e6
        print(f"rdma_read_write ok: provider={ep.provider} write {mb:.1f} MB in "
              f"{(t1 - t0) * 1e3:.2f} ms, read back in {(t2 - t1) * 1e3:.2f} ms, "
              f"100 fetch_add + 2 compare_swap verified", flush=True)
    return 0


def both(args: argparse.Namespace) -> int:
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "target", "--port", "0",
           "--size", args.size, "--host", args.host, "--timeout", str(args.timeout)]
    if args.provider:
        cmd += ["--provider", args.provider]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        m = re.search(r"listening on ([^:]+):(\d+)", proc.stdout.readline())
        if not m:
            print("rdma_read_write: target did not start", file=sys.stderr)
            return 2
        args.port = int(m.group(2))
        rc = run(initiator(args), args.loop)
        proc.wait(args.timeout)
        return rc or proc.returncode
    finally:
        if proc.poll() is None:
            proc.kill()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["both", "target", "initiator"], default="both")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18516)
    p.add_argument("--size", default="4M")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--provider", choices=["soft", "verbs"], default=None)
    p.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto")
    a = p.parse_args()
    if a.role == "target":
        sys.exit(run(target(a), a.loop))
    if a.role == "initiator":
        sys.exit(run(initiator(a), a.loop))
    sys.exit(both(a))
