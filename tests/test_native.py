"""The optional native build (setup.py, aiordma/native.py): what it compiles, how a
process tells which build it runs, and the decorator shim of pure installs."""

from __future__ import annotations

import importlib.machinery
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


def _tree(tmp_path: pathlib.Path, src_age: float, ext_age: float | None,
          lib_age: float | None = None) -> str:
    """A package tree with aiordma/endpoint.py, its extension (``ext_age``) and the
    shared library of the build (``lib_age``), each ``*_age`` seconds old (None: no
    such file)."""
    import time

    pkg = tmp_path / "aiordma"
    pkg.mkdir()
    now = time.time()
    src = pkg / "endpoint.py"
    src.write_text("")
    os.utime(src, (now - src_age, now - src_age))
    if ext_age is not None:
        ext = pkg / ("endpoint" + importlib.machinery.EXTENSION_SUFFIXES[0])
        ext.write_bytes(b"")
        os.utime(ext, (now - ext_age, now - ext_age))
    if lib_age is not None:
        lib = tmp_path.joinpath(*native.SHARED_LIB.split(".")).with_name(
            native.SHARED_LIB.rsplit(".", 1)[1] + importlib.machinery.EXTENSION_SUFFIXES[0])
        lib.write_bytes(b"")
        os.utime(lib, (now - lib_age, now - lib_age))
    return str(tmp_path)


def test_stale_build_is_reported(tmp_path: pathlib.Path) -> None:
    root = _tree(tmp_path, src_age=10, ext_age=100)  # source edited after the build
    with pytest.warns(RuntimeWarning, match="older than the sources of aiordma.endpoint"):
        assert native.warn_if_stale(root) == ["aiordma.endpoint"]


def test_stale_when_the_shared_library_is_old_too(tmp_path: pathlib.Path) -> None:
    assert native.stale_modules(_tree(tmp_path, 10, 100, lib_age=50)) == ["aiordma.endpoint"]


@pytest.mark.parametrize(("src_age", "ext_age", "lib_age"),
                         [(100, 10, None), (10, 11, None), (10, None, None), (10, 100, 5)])
def test_fresh_or_absent_build_is_not_stale(tmp_path: pathlib.Path, src_age: float,
                                            ext_age: float | None,
                                            lib_age: float | None) -> None:
    """Built after the edit, unpacked together (within STALE_AFTER_S), pure, or an
    old shim whose shared library was rebuilt after the edit."""
    assert native.stale_modules(_tree(tmp_path, src_age, ext_age, lib_age)) == []


def test_this_checkout_is_not_stale() -> None:
    assert native.stale_modules() == []
