"""The Soft-RoCE tier's host script (tests/rxe/run-vm.sh) without a VM: where it takes
the Debian mirror for the guest image from."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

RUN_VM = pathlib.Path(__file__).resolve().parent / "rxe" / "run-vm.sh"

SOURCES_LIST = """\
# a comment
deb [arch=amd64 signed-by=/usr/share/keyrings/x.gpg] http://one.example/debian/ bookworm main
deb http://security.example/debian-security bookworm-security main
deb-src http://source.example/debian bookworm main
"""

DEB822 = """\
Types: deb deb-src
URIs: http://two.example/debian
  http://three.example/debian
Suites: forky forky-updates
Components: main

Types: deb
URIs: http://security.example/debian-security
Suites: forky-security
Components: main

Types: deb
URIs: http://disabled.example/debian
Suites: sid
Enabled: no

Types: deb
URIs: http://one.example/debian
Suites: sid
"""


def _mirrors(tmp_path: pathlib.Path, **env: str) -> list[str]:
    r = subprocess.run(["bash", str(RUN_VM), "--print-mirrors"], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, AIORDMA_RXE_CACHE=str(tmp_path / "cache"),
                                            **env))
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.fixture
def apt_config(tmp_path: pathlib.Path) -> pathlib.Path:
    """An apt configuration whose sources live under ``tmp_path``."""
    if shutil.which("apt-config") is None:
        pytest.skip("apt-config is not installed (not a Debian-family host)")
    etc = tmp_path / "etc"
    (etc / "sources.list.d").mkdir(parents=True)
    (etc / "apt.conf.d").mkdir()
    (etc / "sources.list").write_text(SOURCES_LIST)
    (etc / "sources.list.d" / "debian.sources").write_text(DEB822)
    conf = tmp_path / "apt.conf"
    conf.write_text(f'Dir::Etc "{etc}/";\n')
    return conf


def test_mirrors_come_from_the_hosts_apt_sources(tmp_path: pathlib.Path,
                                                 apt_config: pathlib.Path) -> None:
    # deb entries of a release suite, in order, each once; no security or disabled
    # entries, no deb-src
    assert _mirrors(tmp_path, APT_CONFIG=str(apt_config), AIORDMA_RXE_MIRROR="") == [
        "http://one.example/debian", "http://two.example/debian", "http://three.example/debian"]


def test_the_override_variable_wins(tmp_path: pathlib.Path, apt_config: pathlib.Path) -> None:
    assert _mirrors(tmp_path, APT_CONFIG=str(apt_config),
                    AIORDMA_RXE_MIRROR="http://mine.example/debian") == ["http://mine.example/debian"]
