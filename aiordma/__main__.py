"""``python -m aiordma`` (also the ``aiordma`` script).

    python -m aiordma devices           # the RDMA devices this machine offers
    python -m aiordma bench [OPTIONS]   # benchmarks (code under benchmarks/, --help)

The benchmark harness lives in the source tree's ``benchmarks/`` package, outside the
installed package: run it from a checkout (the repository root is put on ``sys.path``
when ``benchmarks`` is not importable otherwise).
"""

from __future__ import annotations

import os
import sys

USAGE = "usage: python -m aiordma {devices,bench} [options]  (bench --help for its options)"


def _bench(argv: list[str]) -> int:
    try:
        from benchmarks.cli import main as bench_main
    except ImportError:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if not os.path.isfile(os.path.join(root, "benchmarks", "cli.py")):
            print("aiordma bench: the benchmarks/ package is not here; run it from a "
                  "source checkout of aiordma", file=sys.stderr)
            return 2
        sys.path.insert(0, root)
        from benchmarks.cli import main as bench_main
    return bench_main(argv)


def _devices() -> int:
    from .verbs import list_devices

    for d in list_devices():
        ports = ", ".join(f"port {p.port_num}: {p.state.name} mtu={int(p.active_mtu)}"
                          for p in d.ports)
        print(f"{d.name:12s} provider={d.provider:6s} active={d.active}  {ports}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd == "bench":
        return _bench(rest)
    if cmd == "devices":
        return _devices()
    print(f"aiordma: unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
