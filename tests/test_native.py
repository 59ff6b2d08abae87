"""The optional native build (setup.py, aiordma/native.py): what it compiles, how a
process tells which build it runs, and the decorator shim of pure installs."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import pathlib
import shutil
import sys

import pytest

from aiordma import native

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _setup_ns() -> dict[str, object]:
    """setup.py's namespace, without running setup()."""
    src = (ROOT / "setup.py").read_text()
    ns: dict[str, object] = {"__name__": "setup_under_test"}  # (not __main__: no setup())
    old = os.getcwd()
    os.chdir(ROOT)
    try:
        exec(compile(src, "setup.py", "exec"), ns)
    finally:
        os.chdir(old)
    return ns


def _in_root(fn: object) -> object:
    old = os.getcwd()
    os.chdir(ROOT)
    try:
        return fn()  # type: ignore[operator]
    finally:
        os.chdir(old)


def test_setup_compiles_exactly_the_listed_modules() -> None:
    ns = _setup_ns()
    paths = _in_root(ns["native_modules"])
    assert paths == [m.replace(".", "/") + ".py" for m in native.MODULES]
    assert isinstance(paths, list) and all((ROOT / p).is_file() for p in paths)
    assert len(set(paths)) == len(paths)
    exts = _in_root(ns["cython_extensions"])
    assert isinstance(exts, list)
    assert [m for m, _src, _h in exts] == [m for _t, m, _h in native.EXTENSIONS]
    for mod, src, headers in exts:
        assert src == mod.replace(".", "/") + ".pyx" and all(h.endswith(".h") for h in headers)
        assert (ROOT / src).is_file() and (ROOT / src).with_suffix(".pxd").is_file()
        assert (ROOT / src).with_suffix(".pyi").is_file(), "mypy needs its Python-level API"
        assert not (ROOT / src).with_suffix(".py").exists(), "one source of truth"
    assert len({t for t, _m, _h in native.EXTENSIONS}) == len(native.EXTENSIONS)


def test_build_reports_what_this_process_runs() -> None:
    compiled = native.compiled_modules()
    assert set(compiled) <= set(native.MODULES)
    build = native.build()
    assert build.modules == ("mypyc" if len(compiled) == len(native.MODULES)
                             else "python" if not compiled else "mixed")
    for name in native.MODULES:
        file = sys.modules[name].__file__ or ""
        assert file.endswith(".py") == (name not in compiled)
    for tag, mod, _headers in native.EXTENSIONS:
        spec = importlib.util.find_spec(mod)
        built = spec is not None and (spec.origin or "").endswith(
            tuple(importlib.machinery.EXTENSION_SUFFIXES))
        assert build.compiled(tag) == built, build
        assert (tag in build.tags) == built and (tag in str(build))
    expected = os.environ.get("AIORDMA_EXPECT_BUILD")
    if expected:  # make test-native, the VM tier: the suite must run the compiled pieces
        missing = set(expected.split(",")) - build.tags
        assert not missing, f"expected the compiled {sorted(missing)}, this runs {build}"


def test_build_says_why_an_extension_is_not_compiled(tmp_path: pathlib.Path) -> None:
    mod = "aiordma.no_such_extension"
    assert native.extension_status(mod, str(tmp_path)).startswith("not compiled (no build")
    (tmp_path / "aiordma").mkdir()
    (tmp_path / "aiordma" / native.BUILD_INFO).write_text(
        json.dumps({"extensions": {mod: "x.h is missing"}}))
    assert native.extension_status(mod, str(tmp_path)) == "not compiled: x.h is missing"
    b = native.Build("python", {"verbs": "not compiled: x.h is missing", "other": ""})
    assert b.tags == {"python", "other"} and not b.compiled("verbs") and b.compiled("other")
    assert str(b) == "python; verbs: not compiled: x.h is missing; other: compiled"
    assert b.label == "python+other"


def test_setup_leaves_out_an_extension_whose_headers_do_not_compile(tmp_path: pathlib.Path) -> None:
    """The header probe of setup.py's build_ext: a missing header is a reason (the
    extension is left out, the pure path runs); the Python headers compile."""
    from setuptools import Distribution

    ns = _setup_ns()
    cmd = ns["BuildExt"](Distribution())  # type: ignore[operator]
    cmd.initialize_options()
    cmd.finalize_options()
    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.sysconfig import customize_compiler

    cmd.compiler = new_compiler()
    customize_compiler(cmd.compiler)
    cmd.compiler.set_include_dirs(cmd.include_dirs)
    why = cmd._headers_compile(("aiordma/no_such_header.h",))
    assert "aiordma/no_such_header.h" in why and "apt install" in why
    if shutil.which("cc") or shutil.which("gcc"):
        assert cmd._headers_compile(("Python.h",)) == ""


def _build_ext(ns: dict[str, object], tmp_path: pathlib.Path, commands: list[str]) -> object:
    """setup.py's BuildExt on a distribution given ``commands``, building into
    ``tmp_path``, finalized."""
    from setuptools import Distribution

    dist = Distribution({"ext_modules": [], "script_name": "setup.py"})
    dist.commands = commands
    cmd = ns["BuildExt"](dist)  # type: ignore[operator]
    cmd.initialize_options()
    cmd.build_lib = cmd.build_temp = str(tmp_path)
    cmd.finalize_options()
    return cmd


def test_mypyc_group_is_built_all_or_nothing(tmp_path: pathlib.Path) -> None:
    """A shim of the mypyc group that fails to compile takes the group's shared library
    and the shims built before it away, and the group out of the extensions to copy or
    install; the Cython extensions are not affected."""
    from setuptools import Extension
    from setuptools.errors import CompileError

    ns = _setup_ns()
    ns["_mypyc_ext_modules"] = lambda: []
    cmd: object = _build_ext(ns, tmp_path, ["build_ext"])
    lib, shim, broken = (Extension(n, [f"{n}.c"]) for n in (
        native.SHARED_LIB, "aiordma.endpoint", "aiordma.onesided"))
    cython = Extension("aiordma.verbs.ibverbs.fastpath", ["x.c"])
    ns["HEADERS"] = {cython.name: ()}  # type: ignore[index]
    built: list[str] = []

    def build_extension(ext: Extension) -> None:
        if ext is broken:
            raise CompileError("gcc: error")
        path = cmd.get_ext_fullpath(ext.name)  # type: ignore[attr-defined]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pathlib.Path(path).write_bytes(b"")
        built.append(path)
        if ext is cython:
            ns["left_out"][ext.name] = ""  # type: ignore[index]

    cmd.build_extension = build_extension  # type: ignore[attr-defined]
    cmd.extensions = [cython, lib, shim, broken]  # type: ignore[attr-defined]
    cmd.build_extensions()  # type: ignore[attr-defined]
    assert len(built) == 3 and os.path.exists(built[0])
    assert not any(os.path.exists(p) for p in built[1:])
    assert ns["left_out"][native.MYPYC_GROUP] == (  # type: ignore[index]
        "compiling mypyc's C failed: gcc: error")
    assert cmd.extensions == [cython]  # type: ignore[attr-defined]


def test_mypyc_group_left_out_says_why(tmp_path: pathlib.Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Without mypy, or with AIORDMA_MYPYC=0, the group is left out with its reason;
    AIORDMA_MYPYC=1 makes a missing mypy fail the build; an sdist does not run mypyc."""
    ns = _setup_ns()
    ns["MYPYC"] = "0"
    assert ns["_mypyc_ext_modules"]() == []  # type: ignore[operator]
    assert ns["left_out"][native.MYPYC_GROUP] == "AIORDMA_MYPYC=0"  # type: ignore[index]
    monkeypatch.setitem(sys.modules, "mypyc.build", None)  # import raises ImportError
    ns["MYPYC"] = "auto"
    assert ns["_mypyc_ext_modules"]() == []  # type: ignore[operator]
    assert ns["left_out"][native.MYPYC_GROUP].startswith(  # type: ignore[index]
        "mypy (mypyc) is not installed")
    ns["MYPYC"] = "1"
    with pytest.raises(SystemExit, match="AIORDMA_MYPYC=1"):
        ns["_mypyc_ext_modules"]()  # type: ignore[operator]

    def no_mypyc() -> list[object]:
        raise AssertionError("an sdist ran mypyc")

    ns["_mypyc_ext_modules"] = no_mypyc
    assert _build_ext(ns, tmp_path, ["sdist"]).extensions == []  # type: ignore[attr-defined]
    b = native.Build("python", {"verbs": ""}, "not compiled: AIORDMA_MYPYC=0")
    assert str(b) == "python (not compiled: AIORDMA_MYPYC=0); verbs: compiled"
    assert b.tags == {"python", "verbs"}


def test_decorator_shim_without_mypy_extensions(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pure install may lack mypy_extensions: the decorator is then the identity."""
    monkeypatch.setitem(sys.modules, "mypy_extensions", None)  # import raises ImportError
    spec = importlib.util.spec_from_file_location(
        "aiordma._native_shim_test", ROOT / "aiordma" / "native.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # (dataclasses look the module up)
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


def test_stale_cython_extension_is_reported(tmp_path: pathlib.Path) -> None:
    import time

    _tag, mod, _h = native.EXTENSIONS[0]
    base = tmp_path.joinpath(*mod.split("."))
    base.parent.mkdir(parents=True)
    now = time.time()
    ext = base.with_name(base.name + importlib.machinery.EXTENSION_SUFFIXES[0])
    for path, age in ((base.with_suffix(".pyx"), 100), (base.with_suffix(".pxd"), 100),
                      (ext, 50)):
        path.write_text("")
        os.utime(path, (now - age, now - age))
    assert native.stale_modules(str(tmp_path)) == []
    os.utime(base.with_suffix(".pxd"), (now - 10, now - 10))  # its C interface edited
    assert native.stale_modules(str(tmp_path)) == [mod]
