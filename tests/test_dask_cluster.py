"""A Dask cluster on rdma:// end to end, against the same cluster on tcp://.

A scheduler and two worker processes, started with Dask's own command line (``python
-m dask scheduler --protocol rdma``, ``python -m dask worker``), a client in this
process: data scattered to one worker is used by a task pinned to the other (it moves
worker to worker over the workers' comms), and a dask array expression computes the same
result as on tcp://. Also ``LocalCluster(protocol="rdma://")``. Skipped where
distributed is not installed. (examples/dask_cluster.py: tests/test_dask_example.py.)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("distributed", minversion="2024.12.1")  # (aiordma[dask])
np = pytest.importorskip("numpy")
da = pytest.importorskip("dask.array")

from _dask import backend_env  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402

import aiordma.dask  # noqa: E402,F401  (registers the backend in this process)

pytestmark = [pytest.mark.dask, pytest.mark.multiprocess]
HOST = os.environ.get("AIORDMA_TEST_IP", "127.0.0.1")
# the most a process may take to come up: a loaded 2-core machine, or (much slower,
# emulated) the Soft-RoCE guest
START_S = 300.0 if os.environ.get("AIORDMA_RXE_GUEST") else 90.0
TEST_TIMEOUT_S = 4 * START_S


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


@contextlib.contextmanager
def cli_cluster(protocol: str, tmp: pathlib.Path, provider: str) -> Iterator[str]:
    """A scheduler and two workers (``--no-nanny``: each worker is one process) on
    ``protocol``; yields the scheduler's address. The processes' output goes to
    ``tmp/<name>.log``, shown when they fail to come up."""
    env = backend_env(provider, tmp)
    sched_file = tmp / f"{protocol}-scheduler.json"
    dask_cli = [sys.executable, "-m", "dask"]
    common = ["--no-dashboard"]
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[pathlib.Path] = []

    def start(name: str, args: list[str]) -> None:
        log = tmp / f"{protocol}-{name}.log"
        logs.append(log)
        with open(log, "wb") as out:
            procs.append(subprocess.Popen(dask_cli + args, env=env, stdout=out,
                                          stderr=subprocess.STDOUT))

    def failed(why: str) -> str:
        return why + "\n" + "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}"
                                      for log in logs)

    try:
        start("scheduler", ["scheduler", "--protocol", protocol, "--host", HOST,
                            "--port", "0", "--scheduler-file", str(sched_file), *common])
        deadline = time.monotonic() + START_S
        while not sched_file.exists() and time.monotonic() < deadline:
            assert procs[0].poll() is None, failed("the scheduler exited")
            time.sleep(0.2)
        assert sched_file.exists(), failed("the scheduler did not come up")
        for i in (1, 2):
            start(f"worker{i}", ["worker", "--scheduler-file", str(sched_file),
                                 "--host", HOST, "--nworkers", "1", "--nthreads", "1",
                                 "--no-nanny",
                                 "--name", f"w{i}", *common])
        import json

        address = json.loads(sched_file.read_text())["address"]
        assert address.startswith(f"{protocol}://"), address
        try:
            yield address
        except BaseException:
            print(failed(f"the {protocol} cluster failed"), file=sys.stderr)
            raise
    finally:
        _stop(procs)


def _workload(client: Client) -> dict[str, Any]:
    """Worker to worker, then a dask array expression; what the test compares."""
    client.wait_for_workers(2, timeout=START_S)
    w1, w2 = sorted(client.scheduler_info()["workers"])
    x = np.random.default_rng(3).random(2_000_000)  # 16 MB: separate frames, zero-copy on rdma
    [fx] = client.scatter([x], workers=[w1])

    def digest_of(a: Any) -> str:  # (nested: pickled by value, workers cannot import us)
        return hashlib.sha256(a.tobytes()).hexdigest()

    fdigest = client.submit(digest_of, fx, workers=[w2], allow_other_workers=False)
    digest = fdigest.result(timeout=START_S)

    def incoming(dask_worker: Any) -> list[tuple[str, list[str]]]:
        return [(t["who"], list(t["keys"])) for t in dask_worker.transfer_incoming_log]

    moved = client.run(incoming, workers=[w2])[w2]
    # integers: exact whatever the order of the sums (float sums may differ in the last
    # bits with the alignment of the chunks in memory, which the transports differ in)
    a = da.random.RandomState(7).randint(0, 1000, (1200, 1200), chunks=(300, 300))
    expr = ((a + a.T) @ a[:, :50]).sum(axis=1) - a.max(axis=0)
    return {"workers": (w1, w2), "digest": digest, "moved": moved, "key": fx.key,
            "array": expr.compute()}


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_cluster_on_rdma_end_to_end(tmp_path: pathlib.Path, provider_name: str) -> None:
    results = {}
    for protocol in ("tcp", "rdma"):
        with cli_cluster(protocol, tmp_path, provider_name) as address:
            with Client(address, timeout=START_S) as client:
                results[protocol] = _workload(client)
    rdma, tcp = results["rdma"], results["tcp"]
    w1, w2 = rdma["workers"]
    assert w1.startswith("rdma://") and w2.startswith("rdma://")
    # the scattered array went from w1 to w2, over the workers' rdma comms
    assert (w1, [rdma["key"]]) in rdma["moved"], rdma["moved"]
    expected = hashlib.sha256(np.random.default_rng(3).random(2_000_000).tobytes()).hexdigest()
    assert rdma["digest"] == tcp["digest"] == expected
    np.testing.assert_array_equal(rdma["array"], tcp["array"])


def test_local_cluster_protocol_rdma(provider_name: str) -> None:
    with LocalCluster(protocol="rdma://", host=HOST, n_workers=2, threads_per_worker=1,
                      processes=False, dashboard_address=None) as cluster:
        assert cluster.scheduler_address.startswith("rdma://")
        with Client(cluster) as client:
            assert all(w.startswith("rdma://") for w in client.scheduler_info()["workers"])
            a = da.arange(200_000, chunks=20_000)
            got = (a * 2).sum().compute()
    assert got == 2 * np.arange(200_000).sum()
