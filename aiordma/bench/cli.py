"""``python -m aiordma bench``: aiordma side by side with its alternatives.

perftest-style tests (``--tests``): ``send_lat write_lat read_lat atomic_lat`` (one
operation at a time, round trips), ``send_bw write_bw read_bw`` (``--window``
operations in flight), ``msg_rate`` (small sends, window ``--rate-window`` = 64; with
``--rate-api many`` aiordma sends them with ``Endpoint.send_many``) and
``reactor`` (the completion reactor alone, in one process). Server and client run
in separate processes.

Baselines (``--baselines``), measured in the same run with the same patterns and
sizes: asyncio TCP and Unix sockets with the Protocol and streams APIs on the same
event loop (``tcp-proto tcp-streams unix-proto unix-streams``), a memory-copy
ceiling (``memcpy``); inside an RDMA-capable VM, ``pyverbs`` (a synchronous busy
loop), ``pyverbs-async`` (the least an asyncio program over pyverbs does) and
``perftest``; UCXX over UCX shared memory with polling and blocking progress
(``ucxx-poll ucxx-block``, send_lat/send_bw/msg_rate; needs aiordma[ucxx]).
Every aiordma figure is reported with its ratio to each matching baseline; the first
(reference) one is ``tcp-proto``.

Every loop is bounded: at most ``--iters`` operations (and ``--max-bytes`` of data)
and ``--max-seconds`` per test; every wait has a timeout.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from aiordma import native

from .common import (
    ALL_TESTS,
    DEFAULT_BASELINES,
    DEFAULT_SIZES,
    DEFAULT_TESTS,
    EXTERNAL_BASELINES,
    LAT_TESTS,
    LOCAL_BASELINES,
    SOCKET_BASELINES,
    TWO_PROCESS_TESTS,
    UCXX_BASELINES,
    Config,
    Result,
    fmt_size,
    parse_sizes,
    test_timeout,
)
from .table import add_ratios, format_table, median_of_rounds

#: the directory that holds the ``aiordma`` package (a checkout or site-packages): the
#: worker processes import this same copy of it
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


DEFAULT_LOOP = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m aiordma bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tests", default=",".join(DEFAULT_TESTS),
                   help=f"comma-separated subset of: {', '.join(ALL_TESTS)} (default: all "
                        "but cost)")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help="message sizes, e.g. 8,64,4K,1M or a power-of-two range 8-16M "
                        f"(default {DEFAULT_SIZES})")
    p.add_argument("--sizes-for", action="append", default=[], metavar="TEST=SIZES",
                   help="sizes of one test, overriding --sizes for it (repeatable), "
                        "e.g. --sizes-for send_lat=64,4K --sizes-for write_bw=1M")
    p.add_argument("--iters", type=int, default=1000,
                   help="operations per test and size (msg_rate: 10x; capped by --max-bytes)")
    p.add_argument("--warmup", type=int, default=100, help="warm-up operations (<= iters/10)")
    p.add_argument("--window", type=int, default=16, help="operations in flight for *_bw")
    p.add_argument("--rate-window", type=int, default=64, help="sends in flight for msg_rate")
    p.add_argument("--rate-api", choices=["send", "many"], default="send",
                   help="how aiordma's msg_rate client sends: send (--rate-window tasks, one "
                        "await per message; the default) or many (Endpoint.send_many calls of "
                        "--rate-window/2 messages, two in flight)")
    p.add_argument("--max-seconds", type=float, default=3.0, help="time bound of each test")
    p.add_argument("--max-bytes", default="512M", help="data bound of each test")
    p.add_argument("--provider", default=None, help="aiordma provider (soft|verbs)")
    p.add_argument("--device", default=None, help="aiordma device name")
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default=DEFAULT_LOOP,
                   help="event loop of every process, baselines included (default: uvloop "
                        "when it is installed, else asyncio)")
    p.add_argument("--poll-mode", choices=["blocking", "hybrid", "polling"], default=None)
    p.add_argument("--spin-us", type=int, default=None)
    p.add_argument("--baselines", default=",".join(DEFAULT_BASELINES),
                   help="comma-separated: " + ", ".join(
                       (*SOCKET_BASELINES, *LOCAL_BASELINES, *EXTERNAL_BASELINES))
                   + "; 'none' for aiordma alone")
    p.add_argument("--no-aiordma", action="store_true", help="run the baselines only")
    p.add_argument("--cpus", default=None, metavar="SERVER,CLIENT",
                   help="pin every transport's server process to CPU SERVER and its client "
                        "to CPU CLIENT, e.g. 1,0 (a host whose placement of the two varies "
                        "between runs; perftest is not pinned)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every transport this many times, alternating the order; "
                        "report the median round of each figure (a noisy machine)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per result on stdout (the table goes to stderr)")
    p.add_argument("--save", metavar="FILE.json", default=None,
                   help="write the results document (date, machine, commit, results) that "
                        "python -m aiordma.bench.report renders")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="plot every test against size (needs matplotlib: aiordma[plot])")
    return p


def config_from_args(a: argparse.Namespace) -> Config:
    from .common import parse_size

    tests = [t.strip() for t in a.tests.split(",") if t.strip()]
    bad = [t for t in tests if t not in ALL_TESTS]
    if bad:
        raise SystemExit(f"bench: unknown test(s) {', '.join(bad)}; choose from "
                         f"{', '.join(ALL_TESTS)}")
    if a.loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        raise SystemExit("bench: --loop uvloop needs the uvloop package "
                         "(pip install 'aiordma[uvloop]')")
    sizes = parse_sizes(a.sizes)
    if not sizes:
        raise SystemExit("bench: --sizes is empty")
    sizes_for: dict[str, list[int]] = {}
    for spec in a.sizes_for:
        test, eq, spec_sizes = spec.partition("=")
        test = test.strip()
        if not eq or test not in ALL_TESTS:
            raise SystemExit(f"bench: --sizes-for needs TEST=SIZES with a known test, not {spec!r}")
        sizes_for[test] = parse_sizes(spec_sizes)
        if not sizes_for[test]:
            raise SystemExit(f"bench: --sizes-for {spec!r} has no size")
    if sizes_for:
        sizes_for = {t: sizes_for.get(t, sizes) for t in tests}
        # every size of the run: the transports size their buffers by the largest
        sizes = sorted({s for t in tests for s in sizes_for[t]})
    if a.iters < 1 or a.window < 1 or a.rate_window < 1 or a.max_seconds <= 0:
        raise SystemExit("bench: --iters, --window, --rate-window and --max-seconds must be positive")
    cpus = _cpus(a.cpus) if a.cpus else None
    return Config(tests=tests, sizes=sizes, iters=a.iters, warmup=max(0, a.warmup),
                  window=a.window, rate_window=a.rate_window, rate_api=a.rate_api,
                  max_seconds=a.max_seconds,
                  max_bytes=parse_size(a.max_bytes), loop=a.loop, provider=a.provider,
                  device=a.device, poll_mode=a.poll_mode, spin_us=a.spin_us,
                  sizes_for=sizes_for, cpus=cpus)


def _cpus(spec: str) -> list[int]:
    """``--cpus SERVER,CLIENT``: two CPU numbers this process may use."""
    parts = spec.split(",")
    try:
        cpus = [int(p) for p in parts]
    except ValueError:
        cpus = []
    if len(cpus) != 2 or min(cpus) < 0:
        raise SystemExit(f"bench: --cpus needs SERVER,CLIENT (two CPU numbers), not {spec!r}")
    allowed = os.sched_getaffinity(0)
    bad = [c for c in cpus if c not in allowed]
    if bad:
        raise SystemExit(f"bench: --cpus {spec}: CPU {bad[0]} is not in this process's "
                         f"set {sorted(allowed)}")
    return cpus


# ======================================================================= running
def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return env


def _drain(stream: Any, sink: list[str]) -> threading.Thread:
    def pump() -> None:
        for line in stream:
            sink.append(line)
    t = threading.Thread(target=pump, daemon=True)
    t.start()
    return t


def run_pair(transport: str, cfg: Config) -> tuple[list[Result], dict[str, Any]]:
    """Run one transport's tests with a server and a client process; after a failed
    test, a new pair of processes runs the rest."""
    results: list[Result] = []
    stats: dict[str, Any] = {}
    total = len(cfg.items())
    while len(results) < total:
        cfg.skip = len(results)
        res, stats = _run_pair_once(transport, cfg)
        cfg.skip = 0
        if not res:
            break
        results += res
    return results, stats


def _run_pair_once(transport: str, cfg: Config) -> tuple[list[Result], dict[str, Any]]:
    cmd = [sys.executable, "-m", "aiordma.bench.worker"]
    n_tests = len(cfg.items()) - cfg.skip
    budget = n_tests * test_timeout(cfg) + 60
    server = subprocess.Popen([*cmd, "server", transport, cfg.to_json()], env=_env(),
                              stdout=subprocess.PIPE, text=True)
    results: list[Result] = []
    stats: dict[str, Any] = {}
    try:
        assert server.stdout is not None
        ready = _readline_timeout(server.stdout, 60)
        if not ready.startswith("READY "):
            raise RuntimeError(f"{transport} server did not start: {ready!r}")
        info = ready[len("READY "):].strip()
        client = subprocess.Popen([*cmd, "client", transport, cfg.to_json(), info],
                                  env=_env(), stdout=subprocess.PIPE, text=True)
        assert client.stdout is not None
        deadline = time.monotonic() + budget
        for line in _lines_until(client.stdout, deadline):
            if line.startswith("RESULT "):
                d = json.loads(line[len("RESULT "):])
                r = Result(**d)
                results.append(r)
                _log(f"  {transport:13s} {r.test:10s} {fmt_size(r.size):>5s}  "
                     + (r.error or _brief(r)))
            elif line.startswith("STATS "):
                stats = json.loads(line[len("STATS "):])
        try:
            client.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            client.kill()
            client.wait(10)
            _log(f"bench: {transport} client killed after {budget:.0f}s")
        if client.returncode:
            _log(f"bench: {transport} client exited with status {client.returncode}")
    finally:
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
    return results, stats


def _readline_timeout(stream: Any, seconds: float) -> str:
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    t.start()
    t.join(seconds)
    return out[0] if out else ""


def _lines_until(stream: Any, deadline: float) -> Iterable[str]:
    lines: list[str] = []
    t = _drain(stream, lines)
    i = 0
    while True:
        while i < len(lines):
            yield lines[i]
            i += 1
        if not t.is_alive() and i >= len(lines):
            return
        if time.monotonic() > deadline:
            return
        t.join(0.05)


def _brief(r: Result) -> str:
    parts = []
    if r.lat_median_us is not None:
        parts.append(f"median {r.lat_median_us:8.1f} us")
    if r.gbps is not None and r.test not in LAT_TESTS:
        parts.append(f"{r.gbps:7.3f} GB/s")
    if r.msgs_per_s is not None:
        parts.append(f"{r.msgs_per_s:10.0f} msg/s")
    if r.cpu_us_per_op is not None:
        parts.append(f"cpu {r.cpu_us_per_op:7.1f} us/op")
    return "  ".join(parts)


def memcpy_ceiling(cfg: Config) -> list[Result]:
    """Bytes per second of a plain buffer copy (``dst[:] = src``) at every size."""
    out = []
    sizes = sorted({s for t in cfg.tests if t in TWO_PROCESS_TESTS for s in cfg.sizes_of(t)})
    for size in sizes:
        src = memoryview(bytearray(size))
        dst = memoryview(bytearray(size))
        for _ in range(3):
            dst[:] = src
        n = max(3, min(cfg.iters * 10, cfg.max_bytes // size))
        deadline = time.perf_counter() + min(cfg.max_seconds, 1.0)
        c0 = time.process_time()
        t0 = time.perf_counter()
        i = 0
        while i < n:
            dst[:] = src
            i += 1
            if not i & 15 and time.perf_counter() > deadline:
                break
        secs = time.perf_counter() - t0
        res = Result("memcpy", "memcpy", size, ops=i, seconds=secs, loop="-")
        res.gbps = i * size / secs / 1e9
        res.msgs_per_s = i / secs
        res.cpu_us_per_op = (time.process_time() - c0) / i * 1e6
        out.append(res)
    return out


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    cpu = ln.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"{platform.system()} {platform.release()}, {os.cpu_count()} CPUs ({cpu}), "
            f"Python {platform.python_version()}")


# ======================================================================= main
def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    cfg = config_from_args(a)
    baselines = [b.strip() for b in a.baselines.split(",") if b.strip() and b.strip() != "none"]
    known = (*SOCKET_BASELINES, *LOCAL_BASELINES, *EXTERNAL_BASELINES)
    bad = [b for b in baselines if b not in known]
    if bad:
        raise SystemExit(f"bench: unknown baseline(s) {', '.join(bad)}; choose from "
                         f"{', '.join(known)}")
    ext = [b for b in baselines if b in EXTERNAL_BASELINES]
    if ext:
        from .external import BaselineUnavailable, check

        for b in ext:
            try:
                check(b, cfg)
            except BaselineUnavailable as exc:
                raise SystemExit(f"bench: baseline {b!r} is unavailable here: {exc}") from None
    if a.save:
        from .report import commit_of

        commit = commit_of(ROOT)
    _log(f"bench: {machine()}; loop {cfg.loop}; tests {','.join(cfg.tests)}; sizes "
         f"{','.join(fmt_size(s) for s in cfg.sizes)}; baselines {','.join(baselines) or 'none'}")
    results: list[Result] = []
    stats: dict[str, Any] = {}
    if "reactor" in cfg.tests and not a.no_aiordma:
        from .reactor import bench as reactor_bench

        _log("bench: reactor micro-benchmark")
        results += reactor_bench(cfg)
    if "cost" in cfg.tests and not a.no_aiordma:
        from .cost import bench as cost_bench

        _log("bench: cost per round trip (callgrind; minutes)")
        try:
            results += cost_bench(cfg, baselines)
        except ValueError as exc:
            raise SystemExit(f"bench: {exc}") from None
    dask_table = ""
    if "dask" in cfg.tests and not a.no_aiordma:
        from aiordma.dask.bench import format_table as dask_format
        from aiordma.dask.bench import run as dask_run

        _log("bench: Dask comms and a cluster workload, tcp:// against rdma://")
        rows = dask_run(max_seconds=cfg.max_seconds, rounds=a.rounds)
        dask_table = "\nDask over tcp:// and rdma:// (aiordma.dask.bench)\n" + dask_format(rows)
        results += [Result(**row) for row in rows]
    two = [t for t in cfg.tests if t in TWO_PROCESS_TESTS]
    if two:
        transports = ([] if a.no_aiordma else ["aiordma"]) + [
            b for b in baselines if b in SOCKET_BASELINES or b in EXTERNAL_BASELINES]
        rounds: list[list[Result]] = []
        for rnd in range(a.rounds):
            # every other round runs the transports in reverse order, so that a load
            # that changes during the run weighs on aiordma and the baselines alike
            order = transports if rnd % 2 == 0 else transports[::-1]
            got: list[Result] = []
            for tr in order:
                _log(f"bench: {tr}" + (f" (round {rnd + 1} of {a.rounds})" if a.rounds > 1 else ""))
                if tr == "perftest":
                    from .external import run_perftest

                    got += run_perftest(cfg, _log)
                    continue
                if tr in UCXX_BASELINES:
                    from .ucxx_baseline import tests_of

                    sub = dataclasses.replace(cfg, tests=tests_of(cfg))
                    if sub.items():
                        got += run_pair(tr, sub)[0]
                    else:
                        _log(f"bench: {tr} runs none of {','.join(two)}")
                    continue
                res, st = run_pair(tr, cfg)
                got += res
                if tr == "aiordma":
                    stats = st
            rounds.append(got)
        results += median_of_rounds(rounds)
        if "memcpy" in baselines:
            results += memcpy_ceiling(cfg)
    add_ratios(results)
    table = format_table(results, baselines)
    out = sys.stderr if a.json else sys.stdout
    print(f"\naiordma bench -- {machine()}", file=out)
    print(f"aiordma build={native.build()} loop={cfg.loop} "
          f"provider={cfg.provider or 'default'} poll_mode="
          f"{cfg.poll_mode or 'default'} iters={cfg.iters} window={cfg.window} "
          f"rate_window={cfg.rate_window} rate_api={cfg.rate_api} "
          f"max_seconds={cfg.max_seconds:g}\n", file=out)
    print(table + dask_table, file=out, flush=True)
    if stats:
        print(f"\naiordma client endpoint statistics: {json.dumps(stats)}", file=out)
    if a.json:
        for r in results:
            print(json.dumps(r.to_dict()), flush=True)
    if a.save:
        from .report import document

        doc = document(results, machine=machine(), build=native.build().label, loop=cfg.loop,
                       provider=cfg.provider, poll_mode=cfg.poll_mode,
                       command=sys.argv[2:] if argv is None else list(argv), commit=commit)
        with open(a.save, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        _log(f"bench: results document written to {a.save}")
    if a.plot:
        from .plot import plot

        plot(results, a.plot, f"aiordma bench: {machine()}")
        _log(f"bench: plot written to {a.plot}")
    return 1 if any(r.error for r in results) else 0
