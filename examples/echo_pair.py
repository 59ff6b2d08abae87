"""Run the echo server and client as two processes (the README's first command).

    python examples/echo_pair.py --count 1000 --size 0,64,4K,1M,64M

Starts ``echo_server.py`` on a free port, runs ``echo_client.py`` against it, stops
the server, and exits with the client's status (bounded by --timeout seconds).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", default="1000")
    p.add_argument("--size", default="0,64,4K,1M,64M")
    p.add_argument("--provider", default=None)
    p.add_argument("--timeout", type=float, default=300.0)
    a = p.parse_args()
    extra = ["--provider", a.provider] if a.provider else []
    server = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "echo_server.py"), "--port", "0", *extra],
        stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        m = re.search(r"listening on ([^:]+):(\d+)", line)
        if not m:
            print(f"echo_pair: server did not start: {line!r}", file=sys.stderr)
            return 2
        print(f"echo_pair: server pid {server.pid} {line.strip()}", flush=True)
        client = subprocess.run(
            [sys.executable, os.path.join(HERE, "echo_client.py"), "--host", m.group(1),
             "--port", m.group(2), "--count", a.count, "--size", a.size, *extra],
            timeout=a.timeout)
        return client.returncode
    except subprocess.TimeoutExpired:
        print(f"echo_pair: client did not finish in {a.timeout:g}s", file=sys.stderr)
        return 3
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
