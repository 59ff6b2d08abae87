"""The ``aiordma`` command (``python -m aiordma``): devices, doctor, bench, each run as
a process from outside the checkout, on the provider under test."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from _procs import HOST, proc_env

from aiordma.doctor import Finding, gid_text, verdict

pytestmark = pytest.mark.multiprocess


def _aiordma(provider: str, *args: str, cwd: str, timeout: float = 120,
             **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aiordma", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd,
                          env=dict(proc_env(provider), **env))


def test_usage_and_unknown_command(tmp_path) -> None:
    r = _aiordma("soft", "--help", cwd=str(tmp_path))
    assert r.returncode == 0 and "devices,doctor,bench" in r.stdout
    r = _aiordma("soft", "nosuch", cwd=str(tmp_path))
    assert r.returncode == 2 and "unknown command 'nosuch'" in r.stderr


def test_devices_prints_the_mtu_in_bytes(provider_name: str, tmp_path) -> None:
    r = _aiordma(provider_name, "devices", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    mtus = re.findall(r"mtu=(\d+)", r.stdout)
    assert mtus and all(int(m) in (256, 512, 1024, 2048, 4096) for m in mtus), r.stdout


def test_doctor_passes_on_the_provider_under_test(provider_name: str, tmp_path) -> None:
    args = ["doctor", "--provider", provider_name]
    if provider_name == "verbs":
        args += ["--host", HOST]
    r = _aiordma(provider_name, *args, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(rf"^\[ ok \] loopback {provider_name} \(.*verified$", r.stdout, re.M), r.stdout
    assert re.search(r"^\[ ok \] device .* MTU \d{3,4} \(max \d{3,4}\), .*GIDs: \[\d+\] ",
                     r.stdout, re.M), r.stdout
    assert re.search(r"^\[( ok |info|warn)\] memlock limit: ", r.stdout, re.M), r.stdout
    assert re.search(r"^\[( ok |info|warn)\] cross-memory attach", r.stdout, re.M), r.stdout
    assert r.stdout.splitlines()[-1].startswith(f"verdict: OK: aiordma works here on {provider_name}")


def test_doctor_fails_when_the_soft_device_cannot_listen(tmp_path) -> None:
    # 203.0.113.0/24 is TEST-NET-3: never an address of this host
    r = _aiordma("soft", "doctor", "--provider", "soft", cwd=str(tmp_path),
                 AIORDMA_SOFT_ADDR="203.0.113.9")
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"^\[FAIL\] .*soft device cannot listen on 203\.0\.113\.9", r.stdout, re.M)
    assert r.stdout.splitlines()[-1].startswith("verdict: FAIL: ")


def test_verdict() -> None:
    ok, warn, fail = Finding("ok", "a"), Finding("warn", "b"), Finding("fail", "c")
    assert verdict([ok], ["soft"]) == (0, "verdict: OK: aiordma works here on soft")
    assert verdict([ok, warn], ["soft", "verbs"]) == (
        0, "verdict: OK: aiordma works here on soft, verbs, 1 warning(s)")
    assert verdict([ok, fail], ["soft"]) == (1, "verdict: FAIL: 1 check(s) failed")
    assert verdict([ok], []) == (1, "verdict: FAIL: no provider passed a loopback")
    assert str(fail) == "[FAIL] c" and str(ok) == "[ ok ] a"


def test_gid_text() -> None:
    assert gid_text(bytes(10) + b"\xff\xff" + bytes([10, 0, 2, 15])) == "::ffff:10.0.2.15 (10.0.2.15)"
    assert gid_text(b"\xfe\x80" + bytes(13) + b"\x01") == "fe80::1"


def test_bench_help_and_a_short_run(provider_name: str, tmp_path) -> None:
    r = _aiordma(provider_name, "bench", "--help", cwd=str(tmp_path))
    assert r.returncode == 0 and "--baselines" in r.stdout, r.stderr
    r = _aiordma(provider_name, "bench", "--tests", "send_lat", "--sizes", "64", "--iters", "20",
                 "--warmup", "2", "--max-seconds", "5", "--baselines", "none", "--json",
                 cwd=str(tmp_path), timeout=200)
    assert r.returncode == 0, r.stdout + r.stderr
    (result,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert (result["transport"], result["test"], result["size"]) == ("aiordma", "send_lat", 64)
    assert result["error"] is None and result["lat_median_us"] > 0


def test_bench_msg_rate_through_send_many(provider_name: str, tmp_path) -> None:
    """``--rate-api many``: aiordma's msg_rate client sends with ``Endpoint.send_many``
    (the result names the call), every message counted by the server (the run fails
    otherwise), and the configuration line says so."""
    r = _aiordma(provider_name, "bench", "--tests", "msg_rate", "--sizes", "64", "--iters",
                 "300", "--warmup", "10", "--max-seconds", "5", "--baselines", "none",
                 "--rate-api", "many", "--rate-window", "16", "--json",
                 cwd=str(tmp_path), timeout=200)
    assert r.returncode == 0, r.stdout + r.stderr
    (result,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert (result["transport"], result["test"], result["size"]) == ("aiordma", "msg_rate", 64)
    assert result["error"] is None and result["ops"] == 3000, result
    assert result["extra"]["api"] == "send_many" and "rate_api=many" in r.stderr
