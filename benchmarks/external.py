"""Baselines that need a real RDMA device (the Soft-RoCE VM, tests/rxe/README.md):
``--baselines pyverbs,perftest``. Each checks what it needs first and raises
``BaselineUnavailable`` with the reason, so a run never silently compares against
nothing.

* ``perftest`` -- runs perftest's ``ib_{send,write,read,atomic}_{lat,bw}`` (server and
  client processes, loopback through the device) with the same sizes and counts and
  parses their tables. perftest prints half the round trip for send/write latency;
  it is doubled here to be comparable with every other latency of this harness.
* ``pyverbs`` -- a busy-polling pyverbs ping-pong: not written yet. The hook checks for
  pyverbs and an ACTIVE port, then says so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time

from .common import Config, Result, test_sizes


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
    if name == "pyverbs":
        _active_verbs_device(cfg)
        raise BaselineUnavailable("pyverbs busy-poll baseline: not implemented yet "
                                  "(hook: benchmarks/external.py)")
    if name == "perftest":
        missing = sorted({b for b in _PERFTEST.values() if shutil.which(b) is None})
        if missing:
            raise BaselineUnavailable(f"perftest binaries not found: {', '.join(missing)} "
                                      "(apt install perftest, inside the Soft-RoCE VM)")
        _active_verbs_device(cfg)
        return
    raise BaselineUnavailable(f"unknown external baseline {name!r}")


_NUM = re.compile(r"^\s*\d+\s+\d+\s+[\d.]+")


def _parse(out: str) -> list[float]:
    rows = [ln.split() for ln in out.splitlines() if _NUM.match(ln)]
    if not rows:
        raise RuntimeError("no result line in perftest output:\n" + out[-2000:])
    return [float(x) for x in rows[-1]]


def run_perftest(cfg: Config) -> list[Result]:
    dev = _active_verbs_device(cfg)
    out: list[Result] = []
    for test in cfg.tests:
        prog = _PERFTEST.get(test)
        if prog is None:
            continue
        for size in test_sizes(test, cfg.sizes):
            _warm, iters = cfg.iters_for(test, size)
            args = [prog, "-d", dev, "-n", str(iters), "-F"]
            if test != "atomic_lat":
                args += ["-s", str(size)]
            if test.endswith("_bw") or test == "msg_rate":
                args += ["-t", str(cfg.window_for(test))]
            res = Result("perftest", test, size, loop="-")
            server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
            try:
                time.sleep(0.5)
                client = subprocess.run(args + ["127.0.0.1"], capture_output=True, text=True,
                                        timeout=cfg.max_seconds * 10 + 30)
                row = _parse(client.stdout)
                if test.endswith("_lat"):
                    # bytes iters t_min t_max t_typical t_avg t_stdev p99 p99.9
                    k = 2.0 if test in ("send_lat", "write_lat") else 1.0
                    res.lat_min_us, res.lat_median_us = row[2] * k, row[4] * k
                    res.lat_mean_us, res.lat_p99_us = row[5] * k, row[7] * k
                    res.ops = int(row[1])
                    res.msgs_per_s = 1e6 / res.lat_median_us if res.lat_median_us else None
                else:
                    # bytes iters bw_peak[MB/s] bw_avg[MB/s] msg_rate[Mpps]; perftest's
                    # MB is 2**20 bytes
                    res.ops = int(row[1])
                    res.gbps = row[3] * 2**20 / 1e9
                    res.msgs_per_s = row[4] * 1e6
                    res.window = cfg.window_for(test)
            except Exception as exc:
                res.error = repr(exc)
            finally:
                server.kill()
                server.wait(10)
            out.append(res)
    return out
