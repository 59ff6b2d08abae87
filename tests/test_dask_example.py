"""examples/dask_cluster.py as a process, on small sizes (a LocalCluster of worker
processes on rdma://). Skipped where distributed is not installed."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("distributed", minversion="2024.12.1")  # (aiordma[dask])
pytest.importorskip("dask.array")

from _dask import HOST, backend_env  # noqa: E402
from _procs import EX  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.multiprocess]


def test_example_dask_cluster(provider_name: str, tmp_path: pathlib.Path) -> None:
    proc = subprocess.run([sys.executable, str(EX / "dask_cluster.py"), "--protocols", "rdma",
                           "--host", HOST, "--size", "8M", "--move", "2M"],
                          env=backend_env(provider_name, tmp_path), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rdma://  scheduler rdma://" in proc.stdout, proc.stdout
    assert "worker-to-worker move of 2 MiB" in proc.stdout
    assert "results: the same" in proc.stdout
