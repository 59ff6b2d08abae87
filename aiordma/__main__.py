"""``python -m aiordma`` (also the ``aiordma`` script).

    python -m aiordma devices           # the RDMA devices this machine offers
    python -m aiordma doctor            # what works here and what does not (exit 0 or 1)
    python -m aiordma bench [OPTIONS]   # benchmarks (aiordma.bench, --help)
"""

from __future__ import annotations

import sys

USAGE = ("usage: python -m aiordma {devices,doctor,bench} [options]  "
         "(doctor --help, bench --help for theirs)")


def _devices(argv: list[str]) -> int:
    from .verbs import list_devices

    for d in list_devices():
        ports = ", ".join(f"port {p.port_num}: {p.state.name} mtu={p.active_mtu.bytes}"
                          for p in d.ports)
        print(f"{d.name:12s} provider={d.provider:6s} active={d.active}  {ports}")
    return 0


def _doctor(argv: list[str]) -> int:
    from .doctor import main as doctor_main

    return doctor_main(argv)


def _bench(argv: list[str]) -> int:
    from .bench.cli import main as bench_main

    return bench_main(argv)


COMMANDS = {"devices": _devices, "doctor": _doctor, "bench": _bench}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    cmd = COMMANDS.get(args[0])
    if cmd is None:
        print(f"aiordma: unknown command {args[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    return cmd(args[1:])


if __name__ == "__main__":
    sys.exit(main())
