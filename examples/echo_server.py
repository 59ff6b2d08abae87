"""aiordma echo server: every message received is sent back.

    python examples/echo_server.py --host 127.0.0.1 --port 18515 [--provider soft]

Prints ``listening on HOST:PORT`` once ready (port 0 picks a free port).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from _common import run

import aiordma


async def echo(ep: aiordma.Endpoint) -> None:
    """Echo until the client closes."""
    async with ep:
        while True:
            try:
                msg = await ep.recv()
            except aiordma.ConnectionClosed:
                return
            await ep.send(msg)


async def main(args: argparse.Namespace) -> int:
    opts = {"provider": args.provider} if args.provider else {}
    listener = await aiordma.listen(echo, args.host, args.port, **opts)
    print(f"listening on {args.host}:{listener.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    listener.close()
    try:  # let connected clients' handlers finish, but do not hang on them
        await asyncio.wait_for(listener.wait_closed(), 10)
    except TimeoutError:
        print("echo_server: connections still open at exit", file=sys.stderr)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18515)
    p.add_argument("--provider", choices=["soft", "verbs"], default=None)
    p.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto")
    a = p.parse_args()
    sys.exit(run(main(a), a.loop))
