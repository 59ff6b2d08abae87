"""Shared by the Dask tests: distributed's own comm test module, wherever it is.

pip's wheels of distributed leave its tests out; Debian's python3-distributed ships
them (the Soft-RoCE guests have it), and ``make setup`` fetches them from there into
``.venv/distributed-tests`` (tests/fetch-distributed-tests.sh). ``upstream_comm_tests()``
returns ``distributed.comm.tests.test_comms`` from an installed distributed that has
it, else from ``$AIORDMA_DISTRIBUTED_TESTS`` (default ``.venv/distributed-tests``),
and skips the calling test when neither has it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import sys
from types import ModuleType

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
HOST = os.environ.get("AIORDMA_TEST_IP", "127.0.0.1")
_NAME = "distributed.comm.tests.test_comms"


def _fetched_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("AIORDMA_DISTRIBUTED_TESTS",
                                       ROOT / ".venv" / "distributed-tests"))


def upstream_comm_tests() -> ModuleType:
    """distributed's ``test_comms`` module (its generic ``check_*`` helpers); skips
    the test when it is nowhere to be found. Raises whatever importing it raises when
    it is there but broken."""
    try:
        return importlib.import_module(_NAME)
    except ModuleNotFoundError as exc:
        if exc.name not in ("distributed.comm.tests", _NAME):
            raise
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    root = _fetched_dir()
    path = root / "distributed" / "comm" / "tests" / "test_comms.py"
    if not path.is_file():
        pytest.skip(f"distributed's comm tests are not installed (pip's wheels leave them "
                    f"out) and not in {root}: run tests/fetch-distributed-tests.sh {root}")
    import distributed.utils_test as utils_test

    # its certificates (loaded at import) lie beside the module, not in the wheel
    utils_test.certs_dir = str(root / "distributed" / "tests")
    spec = importlib.util.spec_from_file_location(_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_NAME]
        raise
    return module


def backend_env(provider: str, tmp: pathlib.Path) -> dict[str, str]:
    """The environment of a Dask process that must know the rdma:// scheme: the
    provider under test and this checkout (``_procs.proc_env``), and -- where aiordma
    is not installed (a checkout on PYTHONPATH: the VM tier) -- a directory on
    PYTHONPATH with the distribution metadata of its entry point, which is how an
    installed aiordma[dask] makes the scheme known to every Dask process."""
    from importlib.metadata import entry_points

    from _procs import proc_env

    env = proc_env(provider)
    if list(entry_points(group="distributed.comm.backends", name="rdma")):
        return env
    info = tmp / "entry-point" / "aiordma_dask_backend-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: aiordma-dask-backend\n"
                                   "Version: 0\n")
    (info / "entry_points.txt").write_text(
        "[distributed.comm.backends]\nrdma = aiordma.dask.backend:RDMABackend\n")
    env["PYTHONPATH"] = os.pathsep.join([str(info.parent), env["PYTHONPATH"]])
    return env
