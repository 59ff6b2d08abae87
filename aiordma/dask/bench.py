"""tcp:// against rdma:// for Dask, measured in the same run, with ratios.

    python -m aiordma.dask.bench [--schemes tcp,rdma] [--sizes 1M,4M,16M,64M]
        [--iters 300] [--bw-iters 20] [--max-seconds 5] [--cluster-mib 256] [--rounds 1]
        [--host 127.0.0.1] [--json PATH]

* ``comm_rtt``: a small Dask message (a dict with 64 payload bytes) written to an echo
  server in another process and read back, one at a time: the median round trip.
* ``comm_bw``: one numpy array of each size written (a separate frame: zero-copy on
  rdma://), the server reads it and answers a small ack: bytes per second.
* ``rechunk``: a ``LocalCluster`` of two worker processes on the scheme; a random
  array of ``--cluster-mib`` MiB in column blocks is rechunked to row blocks (half of it
  moves between the workers) and persisted: the wall time of that step (the array is
  made first and not timed); the result's sum checks that the schemes agree.

The schemes of one measurement run back to back (interleaved per size), so a busy
machine weighs on all alike; ``--rounds N`` repeats everything and reports each row's
median round. ``run()`` returns the rows (dicts with the fields of the
bench CLI's ``Result``: transport, test, size, lat_median_us, gbps, seconds, ...)
and ``format_table()`` prints them with the ratio rdma/tcp (higher is better for
rdma: bandwidth over bandwidth, tcp's time over rdma's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from distributed.comm import connect, listen
from distributed.protocol import to_serialize

from . import frames as fr

KiB = fr.KiB
MiB = fr.MiB
DEFAULT_SIZES = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
SMALL = 64


def parse_size(text: str) -> int:
    """``"64"``, ``"4K"``, ``"16M"``, ``"1G"`` as bytes. Raises ValueError."""
    s = text.strip().upper().removesuffix("B")
    mult = 1
    for suffix, m in (("K", KiB), ("M", MiB), ("G", 1024 * MiB)):
        if s.endswith(suffix):
            s, mult = s[:-1], m
            break
    try:
        n = int(float(s) * mult)
    except ValueError:
        raise ValueError(f"not a size: {text!r}") from None
    if n < 1:
        raise ValueError(f"size must be at least 1 byte: {text!r}")
    return n


def human(n: int) -> str:
    for unit, m in (("GiB", 1024 * MiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------- the echo server
async def _serve(scheme: str, host: str) -> None:
    """An echo server on ``scheme://host``: prints its address, answers ``ping`` with
    the message itself and ``data`` with a small ack, until stdin closes."""
    async def handle(comm: Any) -> None:
        try:
            while True:
                msg = await comm.read()
                if msg.get("op") == "ping":
                    await comm.write(msg)
                else:
                    await comm.write({"op": "ack", "n": msg["x"].nbytes})
        except OSError:  # CommClosedError: the client is done
            pass
        finally:
            await comm.close()

    async with listen(f"{scheme}://{host}", handle) as listener:
        print(listener.contact_address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


class _Server:
    """The echo server of one scheme, in a child process."""

    def __init__(self, scheme: str, host: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "aiordma.dask.bench", "--serve",
                                      scheme, "--host", host], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.address = self.proc.stdout.readline().strip()
        if not self.address:
            self.close()
            raise RuntimeError(f"the {scheme} echo server did not start")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


async def _rtt(address: str, iters: int, max_s: float) -> dict[str, Any]:
    comm = await connect(address)
    try:
        msg = {"op": "ping", "x": b"x" * SMALL}
        for _ in range(min(20, iters)):  # warm-up
            await comm.write(msg)
            await comm.read()
        samples = []
        deadline = time.perf_counter() + max_s
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            await comm.write(msg)
            await comm.read()
            samples.append(time.perf_counter_ns() - t0)
            if time.perf_counter() > deadline:
                break
    finally:
        await comm.close()
    return {"ops": len(samples), "seconds": sum(samples) / 1e9,
            "lat_median_us": statistics.median(samples) / 1e3,
            "lat_min_us": min(samples) / 1e3}


async def _bw(address: str, size: int, iters: int, max_s: float) -> dict[str, Any]:
    comm = await connect(address)
    try:
        x = np.random.default_rng(size).integers(0, 255, size, dtype="u1")
        msg = {"op": "data", "x": to_serialize(x)}
        await comm.write(msg)  # warm-up
        await comm.read()
        n, t0 = 0, time.perf_counter()
        while n < iters and (n == 0 or time.perf_counter() - t0 < max_s):
            await comm.write(msg)
            ack = await comm.read()
            assert ack["n"] == size, ack
            n += 1
        dt = time.perf_counter() - t0
    finally:
        await comm.close()
    return {"ops": n, "seconds": dt, "gbps": size * n / dt / 1e9,
            "lat_median_us": dt / n * 1e6}


def _comm_rows(schemes: Sequence[str], sizes: Sequence[int], iters: int, bw_iters: int,
               max_s: float, host: str) -> list[dict[str, Any]]:
    servers = {s: _Server(s, host) for s in schemes}
    rows: list[dict[str, Any]] = []
    try:
        for s in schemes:
            r = asyncio.run(_rtt(servers[s].address, iters, max_s))
            rows.append({"transport": s, "test": "comm_rtt", "size": SMALL, **r})
        for size in sizes:
            for s in schemes:
                r = asyncio.run(_bw(servers[s].address, size, bw_iters, max_s))
                rows.append({"transport": s, "test": "comm_bw", "size": size, **r})
    finally:
        for srv in servers.values():
            srv.close()
    return rows


# ---------------------------------------------------------------- the cluster workload
def _rechunk(scheme: str, mib: int, host: str) -> dict[str, Any]:
    import dask.array as da
    from distributed import Client, LocalCluster, wait

    n = int((mib * MiB / 8) ** 0.5) // 8 * 8
    with LocalCluster(protocol=f"{scheme}://", host=host, n_workers=2, threads_per_worker=1,
                      processes=True, dashboard_address=None, memory_limit=0) as cluster:
        with Client(cluster):
            x = da.random.RandomState(0).random_sample((n, n), chunks=(n, n // 8))
            x = x.persist()
            wait(x)
            t0 = time.perf_counter()
            y = x.rechunk((n // 8, n)).persist()
            wait(y)
            dt = time.perf_counter() - t0
            checksum = float(y.sum().compute())
            del x, y
    return {"transport": scheme, "test": "rechunk", "size": n * n * 8, "ops": 1,
            "seconds": dt, "gbps": n * n * 8 / 2 / dt / 1e9,
            "extra": {"shape": [n, n], "checksum": checksum}}


# ---------------------------------------------------------------- rows and ratios
def add_ratios(rows: list[dict[str, Any]], reference: str = "tcp") -> None:
    """``row["ratios"]["tcp"]``: how much better the row is than the reference
    scheme's row of the same test and size (>1: better; latency and time inverted)."""
    ref = {(r["test"], r["size"]): r for r in rows if r["transport"] == reference}
    for r in rows:
        base = ref.get((r["test"], r["size"]))
        if base is None or base is r:
            continue
        if r["test"] == "comm_rtt":
            ratio = base["lat_median_us"] / r["lat_median_us"]
        elif r["test"] == "comm_bw":
            ratio = r["gbps"] / base["gbps"]
        else:
            ratio = base["seconds"] / r["seconds"]
        r.setdefault("ratios", {})[reference] = {"speedup": ratio}


def _primary(row: dict[str, Any]) -> float:
    """The figure a row is judged by (higher is better)."""
    if row["test"] == "comm_rtt":
        return -float(row["lat_median_us"])
    if row["test"] == "comm_bw":
        return float(row["gbps"])
    return -float(row["seconds"])


def median_of_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (test, size, scheme), the row of the median round (by its primary figure),
    in the order of the first round; ``extra["rounds"]`` has every round's figure."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for rows in rounds:
        for r in rows:
            groups.setdefault((r["test"], r["size"], r["transport"]), []).append(r)
    out = []
    for group in groups.values():
        ranked = sorted(group, key=_primary)
        row = dict(ranked[(len(ranked) - 1) // 2])
        row["extra"] = {**row.get("extra", {}), "rounds": [abs(_primary(r)) for r in group]}
        out.append(row)
    return out


def run(schemes: Sequence[str] = ("tcp", "rdma"), sizes: Sequence[int] = DEFAULT_SIZES,
        iters: int = 300, bw_iters: int = 20, max_seconds: float = 5.0,
        cluster_mib: int = 256, rounds: int = 1,
        host: str = "127.0.0.1") -> list[dict[str, Any]]:
    """Every measurement, as rows with ratios against tcp:// (see the module
    docstring); with ``rounds`` > 1 everything is measured that many times, the
    schemes interleaved, and each row is its median round (``median_of_rounds``).
    ``cluster_mib=0`` skips the cluster workload; ``host``: the address every server
    listens on (on ``verbs``, the RDMA interface's). Raises ValueError for an unknown
    scheme or bad counts."""
    import aiordma.dask  # noqa: F401  (the rdma scheme, also without the entry point)

    for s in schemes:
        if s not in ("tcp", "rdma"):
            raise ValueError(f"unknown scheme {s!r}: tcp or rdma")
    if iters < 1 or bw_iters < 1 or max_seconds <= 0 or cluster_mib < 0 or rounds < 1:
        raise ValueError("iters, bw_iters, max_seconds and rounds must be positive, "
                         "cluster_mib >= 0")
    results = []
    for _ in range(rounds):
        rows = _comm_rows(schemes, sizes, iters, bw_iters, max_seconds, host)
        if cluster_mib:
            rows += [_rechunk(s, cluster_mib, host) for s in schemes]
        results.append(rows)
    rows = median_of_rounds(results) if rounds > 1 else results[0]
    add_ratios(rows)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    schemes = list(dict.fromkeys(r["transport"] for r in rows))
    keys = list(dict.fromkeys((r["test"], r["size"]) for r in rows))
    by = {(r["test"], r["size"], r["transport"]): r for r in rows}

    def cell(r: dict[str, Any] | None) -> str:
        if r is None:
            return "-"
        if r["test"] == "comm_rtt":
            return f"{r['lat_median_us']:.0f} us"
        if r["test"] == "comm_bw":
            return f"{r['gbps']:.2f} GB/s"
        return f"{r['seconds']:.2f} s"

    head = f"{'test':<10} {'size':>8} " + " ".join(f"{s + '://':>12}" for s in schemes)
    lines = [head + f" {'rdma vs tcp':>12}", "-" * (len(head) + 13)]
    for test, size in keys:
        cells = " ".join(f"{cell(by.get((test, size, s))):>12}" for s in schemes)
        r = by.get((test, size, "rdma"))
        ratio = r.get("ratios", {}).get("tcp", {}).get("speedup") if r else None
        lines.append(f"{test:<10} {human(size):>8} {cells} "
                     f"{(f'{ratio:.2f}x' if ratio else '-'):>12}")
    checks = {r["transport"]: r["extra"]["checksum"] for r in rows if r["test"] == "rechunk"}
    if len(set(checks.values())) > 1:
        lines.append(f"rechunk checksums differ between schemes: {checks}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiordma.dask.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schemes", default="tcp,rdma")
    p.add_argument("--sizes", default=",".join(human(s).replace(" ", "").removesuffix("iB")
                                               for s in DEFAULT_SIZES))
    p.add_argument("--iters", type=int, default=300, help="round trips of comm_rtt")
    p.add_argument("--bw-iters", type=int, default=20, help="messages per comm_bw size")
    p.add_argument("--max-seconds", type=float, default=5.0, help="per measurement")
    p.add_argument("--cluster-mib", type=int, default=256, help="rechunk size; 0: skip")
    p.add_argument("--rounds", type=int, default=1, help="repeat; report the median round")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (verbs: the RDMA interface's)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--serve", help=argparse.SUPPRESS)  # the echo server (child process)
    a = p.parse_args(argv)
    if a.serve:
        import aiordma.dask  # noqa: F401

        asyncio.run(_serve(a.serve, a.host))
        return 0
    sizes = [parse_size(s) for s in a.sizes.split(",") if s.strip()]
    rows = run([s.strip() for s in a.schemes.split(",") if s.strip()], sizes, a.iters,
               a.bw_iters, a.max_seconds, a.cluster_mib, a.rounds, a.host)
    print(f"provider: {os.environ.get('AIORDMA_PROVIDER', '(default)')}, "
          f"{os.cpu_count()} CPUs")
    print(format_table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
