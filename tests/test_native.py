"""The optional native build (setup.py, aiordma/native.py): what it compiles, how a
process tells which build it runs, and the decorator shim of pure installs."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest

from aiordma import native

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _setup_native_modules() -> list[str]:
    """setup.py's native_modules(), run without running setup()."""
    src = (ROOT / "setup.py").read_text().split("ext_modules = []")[0]
    ns: dict[str, object] = {"__name__": "setup_under_test"}
    old = os.getcwd()
    os.chdir(ROOT)
    try:
        exec(compile(src, "setup.py", "exec"), ns)
        out = ns["native_modules"]()  # type: ignore[operator]
    finally:
        os.chdir(old)
    assert isinstance(out, list)
    return out


def test_setup_compiles_exactly_the_listed_modules() -> None:
    paths = _setup_native_modules()
    assert paths == [m.replace(".", "/") + ".py" for m in native.MODULES]
    assert all((ROOT / p).is_file() for p in paths)
    assert len(set(paths)) == len(paths)


def test_build_reports_what_this_process_runs() -> None:
    compiled = native.compiled_modules()
    assert set(compiled) <= set(native.MODULES)
    build = native.build()
    assert build == ("mypyc" if len(compiled) == len(native.MODULES)
                     else "python" if not compiled else "mixed")
    expected = os.environ.get("AIORDMA_EXPECT_BUILD")
    if expected:  # make test-native: the suite must really run the compiled modules
        assert build == expected, f"expected the {expected} build, run {build}: {compiled}"
    for name in native.MODULES:
        file = sys.modules[name].__file__ or ""
        assert file.endswith(".py") == (name not in compiled)


def test_decorator_shim_without_mypy_extensions(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pure install may lack mypy_extensions: the decorator is then the identity."""
    monkeypatch.setitem(sys.modules, "mypy_extensions", None)  # import raises ImportError
    spec = importlib.util.spec_from_file_location(
        "aiordma._native_shim_test", ROOT / "aiordma" / "native.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    class C:
        pass

    assert mod.mypyc_attr(native_class=False)(C) is C
