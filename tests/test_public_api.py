"""The public API: every public name of ``aiordma`` is in ``__all__``, and every name
in ``__all__`` resolves (the asyncio helpers load lazily)."""

from __future__ import annotations

import subprocess
import sys
import types

import aiordma

#: the names the manual and the design's API contract promise
CONTRACT = {
    "listen", "connect", "create_connection", "create_server", "open_connection",
    "start_server", "list_devices", "open_device", "Endpoint", "Listener", "RDMATransport",
    "MemoryRegion", "RemoteBuffer", "Device", "DeviceInfo", "PortInfo", "RDMAError",
    "CompletionError", "ConnectionClosed", "HandshakeError", "MessageTooLarge",
}


def test_the_contract_is_in_all() -> None:
    assert CONTRACT <= set(aiordma.__all__), sorted(CONTRACT - set(aiordma.__all__))


def test_every_name_in_all_resolves_and_is_listed_once() -> None:
    assert len(aiordma.__all__) == len(set(aiordma.__all__))
    for name in aiordma.__all__:
        assert getattr(aiordma, name) is not None, name


def test_every_public_name_is_in_all() -> None:
    for name in aiordma.__all__:  # load the lazy ones, so that dir() shows them
        getattr(aiordma, name)
    public = {n for n in dir(aiordma) if not n.startswith("_")
              and not isinstance(getattr(aiordma, n), types.ModuleType)
              and n not in ("annotations", "Any")}
    assert public <= set(aiordma.__all__), sorted(public - set(aiordma.__all__))


def test_star_import_in_a_fresh_interpreter() -> None:
    code = ("from aiordma import *; import aiordma; "
            "assert all(n in globals() for n in aiordma.__all__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
