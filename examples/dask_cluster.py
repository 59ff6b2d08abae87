"""A Dask cluster on rdma://: a scheduler and worker processes, a computation, the numbers.

    python examples/dask_cluster.py                       # rdma:// (then tcp:// to compare)
    python examples/dask_cluster.py --protocols rdma --workers 4 --size 512M

Needs ``pip install 'aiordma[dask]'`` (distributed, dask[array], numpy). For each
protocol it starts a ``LocalCluster`` (a scheduler and ``--workers`` worker processes),
then

1. scatters a numpy array to the first worker and runs a task on the second that
   uses it: the array moves worker to worker, and the worker's transfer log gives the
   bandwidth of that move;
2. makes a random array of ``--size`` bytes in column blocks, rechunks it to row blocks
   (most of it moves between workers) and reduces it: the wall time of each step.

It prints the numbers of each protocol, and exits non-zero if the protocols' results
differ (the moved bytes, and the reduction to 1e-12). The soft provider serves one host by default (``AIORDMA_SOFT_ADDR=0.0.0.0``
for several; on real RDMA, give the RDMA interface's address with ``--host``).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from typing import Any

import dask.array as da
import numpy as np
from _common import parse_size
from distributed import Client, LocalCluster, wait


def _digest(x: np.ndarray) -> str:
    return hashlib.sha256(x.tobytes()).hexdigest()


def run(protocol: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with LocalCluster(protocol=f"{protocol}://", host=args.host, n_workers=args.workers,
                      threads_per_worker=1, processes=True, dashboard_address=None,
                      memory_limit=0) as cluster, Client(cluster) as client:
        out["scheduler"] = cluster.scheduler_address
        w1, w2 = sorted(client.scheduler_info()["workers"])[:2]

        # 1. worker to worker
        x = np.random.default_rng(0).random(args.move // 8)
        [fx] = client.scatter([x], workers=[w1])
        digest = client.submit(_digest, fx, workers=[w2], allow_other_workers=False).result()
        log = client.run(lambda dask_worker: list(dask_worker.transfer_incoming_log),
                         workers=[w2])[w2]
        move = [t for t in log if fx.key in t["keys"]]
        out["move_gbps"] = move[-1]["total"] / move[-1]["duration"] / 1e9 if move else None
        out["digest"] = digest

        # 2. rechunk and reduce
        n = int((args.size / 8) ** 0.5) // 8 * 8
        a = da.random.RandomState(1).random_sample((n, n), chunks=(n, n // 8)).persist()
        wait(a)
        t0 = time.perf_counter()
        b = a.rechunk((n // 8, n)).persist()
        wait(b)
        out["rechunk_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        out["result"] = (b - b.mean(axis=0)).std(axis=1).compute()
        out["reduce_s"] = time.perf_counter() - t0
        out["array"] = f"{n}x{n} float64, {n * n * 8 / 2**20:.0f} MiB"
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--protocols", default="rdma,tcp", help="comma-separated: rdma,tcp")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--host", default="127.0.0.1", help="address the cluster listens on")
    p.add_argument("--size", default="256M", help="the rechunked array (K/M/G)")
    p.add_argument("--move", default="64M", help="the array moved worker to worker")
    args = p.parse_args()
    args.size, args.move = parse_size(args.size), parse_size(args.move)
    if args.workers < 2:
        p.error("--workers must be at least 2 (data moves between two of them)")
    results = {}
    for protocol in [s.strip() for s in args.protocols.split(",") if s.strip()]:
        r = results[protocol] = run(protocol, args)
        move = f"{r['move_gbps']:.2f} GB/s" if r["move_gbps"] else "n/a"
        print(f"{protocol:>5}://  scheduler {r['scheduler']}, {args.workers} workers, "
              f"{r['array']}")
        print(f"{'':>8} worker-to-worker move of {args.move >> 20} MiB: {move}; "
              f"rechunk {r['rechunk_s']:.2f} s; reduce {r['reduce_s']:.2f} s")
    if "rdma" in results and "tcp" in results:
        rd, tc = results["rdma"], results["tcp"]
        print(f"rdma vs tcp: rechunk {tc['rechunk_s'] / rd['rechunk_s']:.2f}x, "
              f"reduce {tc['reduce_s'] / rd['reduce_s']:.2f}x" + (
                  f", move {rd['move_gbps'] / tc['move_gbps']:.2f}x"
                  if rd["move_gbps"] and tc["move_gbps"] else ""))
    # (float reductions may differ in the last bits with the alignment of the chunks
    # each transport leaves in memory: numpy's SIMD sums depend on it)
    first = next(iter(results.values()))
    same = all(r["digest"] == first["digest"]
               and np.allclose(r["result"], first["result"], rtol=1e-12, atol=0)
               for r in results.values())
    print("results: " + ("the same across protocols" if same else "DIFFER"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
