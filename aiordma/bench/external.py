"""Baselines outside the socket set: those that need a real RDMA device (the Soft-RoCE
VM, tests/rxe/README.md; ``make bench-rxe``): ``--baselines pyverbs,pyverbs-async,perftest``,
and UCXX (``ucxx-poll,ucxx-block``; ``make bench-ucxx``). Each checks what it needs first
and raises ``BaselineUnavailable`` with the reason, so a run never silently compares
against nothing.

* ``pyverbs`` -- a synchronous, busy-polling pyverbs program (``aiordma/bench/pyverbs_sync.py``):
  server and client processes, one RC QP over the device, connection data exchanged
  over a plain TCP socket, work requests built once and re-posted, ``cq.poll()`` in a
  loop. Same tests, sizes, counts and measurement as aiordma's (it runs through
  ``aiordma/bench/worker.py`` and the same pair runner, rounds included); its CPU per
  operation counts both busy-polling processes.
* ``pyverbs-async`` -- the same verbs objects and WRs driven from an asyncio loop at
  the least cost (``aiordma/bench/pyverbs_async.py``): one Future per operation, resolved
  by a CQ poller re-scheduled every loop iteration; the floor of any asyncio program
  over pyverbs, run through the same harness as aiordma.
* ``perftest`` -- runs perftest's ``ib_{send,write,read,atomic}_{lat,bw}`` (a server and
  a client process, loopback through the device: ``-d DEV -x GID_INDEX -p PORT -n
  ITERS -s SIZE``, ``-t WINDOW`` for bandwidth; the GID index is the one aiordma picks,
  the RoCE v2 IPv4 GID, 1 on the VM's rxe0) and parses the client's table. perftest
  prints half the round trip for send/write latency (ping-pong); it is doubled here to
  be comparable with every other latency of this harness. Its bandwidth unit is read
  from the header (``MiB/sec``/``MB/sec`` = 2**20 B, ``Gb/sec``). perftest takes its
  turn in every round like the other transports; it reports no CPU time.

* ``ucxx-poll``, ``ucxx-block`` -- UCXX's asyncio API over UCX shared memory on one host
  (no RDMA device), polling and blocking progress (``aiordma/bench/ucxx_baseline.py``).

pyverbs and perftest busy-poll: on a machine with as few cores as busy-polling processes (the 2-vCPU
VM), they compete with the kernel's rxe work for the CPUs, which shows in their tails.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable

from .common import UCXX_BASELINES, Config, Result, fmt_size


class BaselineUnavailable(RuntimeError):
    pass


def _active_verbs_device(cfg: Config) -> str:
    try:
        import pyverbs  # noqa: F401
    except ImportError as exc:
        raise BaselineUnavailable(
            f"pyverbs is not importable ({exc}); install python3-pyverbs (rdma-core) and run "
            "inside the Soft-RoCE VM (make test-rxe, tests/rxe/README.md)") from None
    import aiordma

    devs = [d for d in aiordma.list_devices() if d.provider == "verbs" and d.active]
    if cfg.device:
        devs = [d for d in devs if d.name == cfg.device]
    if not devs:
        raise BaselineUnavailable("no ACTIVE RDMA port (verbs provider): load rdma_rxe and "
                                  "add a link (rdma link add rxe0 type rxe netdev eth0)")
    return str(devs[0].name)


_PERFTEST = {
    "send_lat": "ib_send_lat", "write_lat": "ib_write_lat", "read_lat": "ib_read_lat",
    "atomic_lat": "ib_atomic_lat", "send_bw": "ib_send_bw", "write_bw": "ib_write_bw",
    "read_bw": "ib_read_bw", "msg_rate": "ib_send_bw",
}


def check(name: str, cfg: Config) -> None:
    """Raise BaselineUnavailable unless baseline ``name`` can run here."""
    if name in ("pyverbs", "pyverbs-async"):
        _active_verbs_device(cfg)
        return
    if name == "perftest":
        missing = sorted({b for b in _PERFTEST.values() if shutil.which(b) is None})
        if missing:
            raise BaselineUnavailable(f"perftest binaries not found: {', '.join(missing)} "
                                      "(apt install perftest, inside the Soft-RoCE VM)")
        _active_verbs_device(cfg)
        return
    if name in UCXX_BASELINES:
        from .ucxx_baseline import unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            raise BaselineUnavailable(reason)
        return
    raise BaselineUnavailable(f"unknown external baseline {name!r}")


_NUM = re.compile(r"^\s*\d+\s+\d+\s+[\d.]+")


def _parse(out: str) -> tuple[list[float], str]:
    """The last result row of a perftest table and its header line."""
    lines = out.splitlines()
    head = ""
    row: list[float] | None = None
    for ln in lines:
        if "#bytes" in ln:
            head = ln
        elif _NUM.match(ln):
            row = [float(x) for x in ln.split()]
    if row is None:
        raise RuntimeError("no result line in perftest output:\n" + out[-2000:])
    return row, head


def _bw_unit(head: str) -> float:
    """Bytes per second of one unit of perftest's BW column: MB/sec and MiB/sec are
    2**20 bytes (perftest's MB always was), Gb/sec is 10**9 bits."""
    if "Gb/sec" in head:
        return 1e9 / 8
    if "MB/sec" in head or "MiB/sec" in head:
        return float(2**20)
    raise RuntimeError(f"unknown perftest bandwidth unit in {head!r}")


def _gid_index(dev: str) -> int | None:
    """The GID index aiordma would use for a peer on this host (RoCE: the RoCE v2 IPv4
    GID, AIORDMA_GID_INDEX overrides); None on InfiniBand (LID addressing)."""
    from aiordma.verbs.ibverbs import compat

    entries = compat.read_sysfs_gids(dev, 1)
    try:
        with open(f"{compat.SYSFS_INFINIBAND}/{dev}/ports/1/link_layer") as f:
            if f.read().strip() == "InfiniBand":
                return None
    except OSError:
        pass
    return compat.select_gid_index(entries or [], "127.0.0.1", dev=dev)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    """Whether a TCP socket of this host listens on ``port`` (/proc/net/tcp{,6}: no
    connection is made, which would be the perftest server's one client)."""
    want = f":{port:04X}"
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f, None)
                for line in f:
                    parts = line.split()
                    if len(parts) > 3 and parts[1].endswith(want) and parts[3] == "0A":
                        return True
        except OSError:
            continue
    return False


def _wait_listening(proc: subprocess.Popen[str], port: int, seconds: float) -> None:
    """Wait until the perftest server listens (its banner is of no use: stdout is a
    pipe, so it is buffered until the process exits)."""
    deadline = time.monotonic() + seconds
    while not _listening(port):
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout is not None else ""
            raise RuntimeError(f"perftest server exited with {proc.returncode}: {out[-1500:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"perftest server not listening on port {port} after {seconds:.0f}s")
        time.sleep(0.05)


def perftest_args(test: str, size: int, cfg: Config, dev: str, gid_index: int | None,
                  port: int) -> list[str]:
    """The command line of both perftest processes (the client adds the server address)."""
    prog = _PERFTEST[test]
    _warm, iters = cfg.iters_for(test, size)
    window = cfg.window_for(test)
    args = [prog, "-d", dev, "-p", str(port), "-F", "-n", str(max(5, iters, window))]
    if gid_index is not None:
        args += ["-x", str(gid_index)]
    if test != "atomic_lat":
        args += ["-s", str(size)]
    if test.endswith("_bw") or test == "msg_rate":
        args += ["-t", str(window)]
    return args


def run_perftest(cfg: Config, log: Callable[[str], None] | None = None) -> list[Result]:
    dev = _active_verbs_device(cfg)
    gid_index = _gid_index(dev)
    out: list[Result] = []
    for test in cfg.tests:
        if test not in _PERFTEST:
            continue
        for size in cfg.sizes_of(test):
            port = _free_port()
            args = perftest_args(test, size, cfg, dev, gid_index, port)
            res = Result("perftest", test, size, loop="-")
            res.note = " ".join(args)
            server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
            try:
                _wait_listening(server, port, 30)
                client = subprocess.run(args + ["127.0.0.1"], capture_output=True, text=True,
                                        timeout=cfg.max_seconds * 10 + 60)
                if client.returncode:
                    raise RuntimeError(f"{args[0]} exited with {client.returncode}: "
                                       + (client.stdout + client.stderr)[-1500:])
                row, head = _parse(client.stdout)
                res.ops = int(row[1])
                if test.endswith("_lat"):
                    # bytes iters t_min t_max t_typical t_avg t_stdev p99 p99.9; send and
                    # write latency are half round trips (ping-pong), doubled here
                    k = 2.0 if test in ("send_lat", "write_lat") else 1.0
                    res.lat_min_us, res.lat_median_us = row[2] * k, row[4] * k
                    res.lat_mean_us, res.lat_p99_us = row[5] * k, row[7] * k
                    res.msgs_per_s = 1e6 / res.lat_median_us if res.lat_median_us else None
                else:
                    # bytes iters bw_peak bw_avg msg_rate[Mpps]
                    res.gbps = row[3] * _bw_unit(head) / 1e9
                    res.msgs_per_s = row[4] * 1e6
                    res.window = cfg.window_for(test)
                    res.seconds = res.ops / res.msgs_per_s if res.msgs_per_s else 0.0
            except Exception as exc:
                res.error = repr(exc)
            finally:
                server.kill()
                server.wait(10)
            if log is not None:
                fig = (f"median {res.lat_median_us:8.1f} us" if res.lat_median_us is not None
                       else f"{res.gbps or 0.0:7.3f} GB/s")
                log(f"  {'perftest':13s} {test:10s} {fmt_size(size):>5s}  " + (res.error or fig))
            out.append(res)
    return out
