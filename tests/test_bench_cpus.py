"""``python -m aiordma bench --cpus SERVER,CLIENT``: each worker pins itself to its CPU."""

from __future__ import annotations

import os
import threading

import pytest

from aiordma.bench.cli import _parser, config_from_args
from aiordma.bench.common import Config


def _config(*argv: str) -> Config:
    return config_from_args(_parser().parse_args(["--tests", "send_lat", *argv]))


def _affinity_after_pin(cfg: Config, role: str) -> set[int]:
    """The CPU set of a thread that ran ``cfg.pin(role)`` (sched_setaffinity(0) pins
    the calling thread only, so the test's own threads keep theirs)."""
    got: list[set[int]] = []

    def pin() -> None:
        cfg.pin(role)
        got.append(os.sched_getaffinity(0))

    t = threading.Thread(target=pin)
    t.start()
    t.join(10)
    assert got, "the pinning thread did not finish"
    return got[0]


def test_without_cpus_nothing_is_pinned() -> None:
    cfg = _config()
    assert cfg.cpus is None
    assert _affinity_after_pin(cfg, "client") == os.sched_getaffinity(0)


def test_the_server_and_the_client_pin_to_their_cpu() -> None:
    last = max(os.sched_getaffinity(0))
    first = min(os.sched_getaffinity(0))
    cfg = _config("--cpus", f"{last},{first}")
    assert cfg.cpus == [last, first]
    assert Config.from_json(cfg.to_json()).cpus == [last, first]  # what the workers get
    assert _affinity_after_pin(cfg, "server") == {last}
    assert _affinity_after_pin(cfg, "client") == {first}


@pytest.mark.parametrize("spec", ["1", "0,1,2", "a,b", "-1,0", ","])
def test_a_malformed_cpus_is_refused(spec: str) -> None:
    with pytest.raises(SystemExit, match="--cpus needs SERVER,CLIENT"):
        _config(f"--cpus={spec}")


def test_a_cpu_outside_the_process_set_is_refused() -> None:
    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(SystemExit, match=f"CPU {outside} is not in"):
        _config("--cpus", f"0,{outside}")
