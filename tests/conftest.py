"""Shared fixtures: provider and event-loop parametrisation, hard timeouts.

* ``provider_name``: the provider under test: ``AIORDMA_PROVIDER`` (default ``soft``).
  With ``verbs`` and no ACTIVE port the tests needing a device skip (in the rxe VM the
  runner itself fails when no port is active, so nothing is skipped silently there).
* Every async test runs on both the default asyncio loop and uvloop (when installed),
  through pytest-asyncio's ``event_loop_policy`` fixture.
* Every async test has a hard in-loop timeout (``AIORDMA_TEST_TIMEOUT``, default 60 s,
  or its ``timeout`` marker) that prints every task's stack on expiry; pytest-timeout
  (thread method, 300 s in pyproject) is the last resort for anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import io
import os
import re
from collections.abc import Iterator

import pytest
import pytest_asyncio

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is in the test extra
    uvloop = None

LOOPS = ["asyncio"] + (["uvloop"] if uvloop is not None else [])


@pytest.fixture(scope="session")
def provider_name() -> str:
    name = os.environ.get("AIORDMA_PROVIDER", "soft")
    if name == "verbs":
        from aiordma.verbs import get_provider

        # Inside the Soft-RoCE VM a missing device is a failure, never a skip.
        give_up = pytest.fail if os.environ.get("AIORDMA_RXE_GUEST") else pytest.skip
        try:
            devs = get_provider("verbs").list_devices()
        except Exception as exc:  # pragma: no cover - depends on the machine
            give_up(f"verbs provider unavailable: {exc}")
        if not any(d.active for d in devs):
            give_up("no ACTIVE RDMA port for the verbs provider")
    return name


_PYTEST_ASYNCIO = tuple(int(p) for p in re.findall(r"\d+", pytest_asyncio.__version__)[:2])


def pytest_addoption(parser: pytest.Parser) -> None:
    """pyproject sets ``asyncio_default_fixture_loop_scope`` for pytest-asyncio >= 0.24
    (which warns when it is unset); older ones (Debian bookworm's 0.20) do not declare
    it, and pytest would warn "Unknown config option": declare it for them (it changes
    nothing there)."""
    if _PYTEST_ASYNCIO < (0, 24):  # pragma: no cover - older pytest-asyncio
        parser.addini("asyncio_default_fixture_loop_scope",
                      "pytest-asyncio >= 0.24's option; this pytest-asyncio ignores it")

try:  # pytest-asyncio >= 1.3: loop factories parametrise only the async tests
    from pytest_asyncio.plugin import PytestAsyncioSpecs  # noqa: F401

    _HAVE_FACTORIES = hasattr(PytestAsyncioSpecs, "pytest_asyncio_loop_factories")
except ImportError:  # pragma: no cover - older pytest-asyncio (e.g. Debian's)
    _HAVE_FACTORIES = False

if _HAVE_FACTORIES:

    def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict:
        factories = {"asyncio": asyncio.new_event_loop}
        if uvloop is not None:
            factories["uvloop"] = uvloop.new_event_loop
        return factories

elif _PYTEST_ASYNCIO >= (0, 23):  # pragma: no cover

    @pytest.fixture(params=LOOPS)
    def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
        if request.param == "uvloop":
            assert uvloop is not None
            return uvloop.EventLoopPolicy()
        return asyncio.DefaultEventLoopPolicy()

else:  # pragma: no cover - pytest-asyncio < 0.23 (Debian bookworm's 0.20): no policy fixture
    # It asks for ``event_loop`` at run time, too late for a parametrised fixture: the
    # async tests are parametrised here with ``aiordma_loop``, which event_loop reads.

    def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
        if inspect.iscoroutinefunction(metafunc.function):
            metafunc.fixturenames.append("aiordma_loop")
            metafunc.parametrize("aiordma_loop", LOOPS, indirect=True)

    @pytest.fixture
    def aiordma_loop(request: pytest.FixtureRequest) -> str:
        return str(request.param)

    @pytest.fixture
    def event_loop(request: pytest.FixtureRequest) -> Iterator[asyncio.AbstractEventLoop]:
        name = (request.getfixturevalue("aiordma_loop")
                if "aiordma_loop" in request.fixturenames else "asyncio")
        loop = uvloop.new_event_loop() if name == "uvloop" else asyncio.new_event_loop()
        yield loop
        loop.close()


@pytest.fixture
def ctx(provider_name: str):
    """An open device context of the provider under test, closed after the test."""
    from aiordma.verbs import open_context

    c = open_context(provider=provider_name)
    yield c
    c.close()


#: The soft provider's same-host cross-memory attach (verbs/soft/cma.py) on for every
#: RDMA READ/WRITE (AIORDMA_SOFT_CMA_MIN=1) and off; a single run for other providers.
SOFT_CMA_MODES = (["cma", "nocma"] if os.environ.get("AIORDMA_PROVIDER", "soft") == "soft"
                  else ["default"])


@pytest.fixture(params=SOFT_CMA_MODES)
def soft_cma(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a module's tests (``pytestmark = pytest.mark.usefixtures("soft_cma")``) with
    the soft device's CMA on and off; child processes inherit the setting."""
    if request.param == "cma":
        monkeypatch.setenv("AIORDMA_SOFT_CMA", "1")
        monkeypatch.setenv("AIORDMA_SOFT_CMA_MIN", "1")
    elif request.param == "nocma":
        monkeypatch.setenv("AIORDMA_SOFT_CMA", "0")
    return str(request.param)


ASYNC_TEST_TIMEOUT = float(os.environ.get("AIORDMA_TEST_TIMEOUT", "60"))


def _with_hard_timeout(fn, seconds: float):  # type: ignore[no-untyped-def]
    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        task = asyncio.ensure_future(fn(*args, **kwargs))
        done, _ = await asyncio.wait({task}, timeout=seconds)
        if task in done:
            return task.result()
        stacks = []
        for t in asyncio.all_tasks():
            if t is asyncio.current_task():
                continue
            buf = io.StringIO()
            t.print_stack(file=buf)
            stacks.append(buf.getvalue())
        task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait({task}, timeout=5)
        pytest.fail(f"async test exceeded its hard timeout of {seconds:g}s; tasks:\n"
                    + "\n".join(stacks), pytrace=False)

    return wrapper


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every async test runs under a hard in-loop timeout (works on uvloop too, where a
    SIGALRM handler cannot interrupt the C event loop); on expiry every task's stack is
    printed and the test fails. pytest-timeout (thread method) stays as the last resort."""
    for item in items:
        fn = getattr(item, "obj", None)
        if fn is None or not inspect.iscoroutinefunction(fn):
            continue
        marker = item.get_closest_marker("timeout")
        seconds = float(marker.args[0]) if marker and marker.args else ASYNC_TEST_TIMEOUT
        item.obj = _with_hard_timeout(fn, seconds)  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The figures tests measured (``_peers.figure``: fault detection times, traffic
    under faults), after the run: printed, never asserted on."""
    from _peers import FIGURES

    if FIGURES:
        terminalreporter.section("measured figures")
        for line in FIGURES:
            terminalreporter.write_line(line)
