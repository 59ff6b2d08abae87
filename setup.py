"""aiordma's compiled modules; the pure-Python sources always work alone.

Cython (``aiordma.native.EXTENSIONS``): built by default -- ``pip install .``, ``python
setup.py build_ext --inplace`` (``make native``) -- where a C compiler, Cython and the C
headers each module needs are found. A module whose compiler, Cython or headers are
missing, or that fails to compile, is left out: its pure-Python path runs instead, and
the build says why on stderr and in ``aiordma/_build.json`` (``aiordma.native.build()``
reads it).

mypyc (``aiordma.native.MODULES``): only with ``AIORDMA_MYPYC=1`` (``make native``).

``AIORDMA_BUILD``: ``auto`` (the default, as above), ``python`` (compile nothing), or
``compiled`` (every Cython extension, or the build fails: ``make native``, the VM tier).
``build_in_place()`` builds without reading pyproject.toml (the VM tier's guests).
"""

from __future__ import annotations

import ast
import json
import os
import sys
import tempfile
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

MODE = os.environ.get("AIORDMA_BUILD", "auto")
if MODE not in ("auto", "python", "compiled"):
    raise SystemExit(f"AIORDMA_BUILD={MODE!r}: use auto, python or compiled")


def _native_literal(name: str) -> Any:
    """The literal ``name`` assigned in aiordma/native.py, read without importing it."""
    with open(os.path.join("aiordma", "native.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id == name and node.value is not None):
            return ast.literal_eval(node.value)
    raise SystemExit(f"aiordma/native.py: no {name}")


def native_modules() -> list[str]:
    """``aiordma.native.MODULES`` as source paths (mypyc)."""
    return [m.replace(".", "/") + ".py" for m in _native_literal("MODULES")]


def cython_extensions() -> list[tuple[str, str, tuple[str, ...]]]:
    """``aiordma.native.EXTENSIONS`` as ``(module, .pyx source path, headers)``."""
    return [(mod, mod.replace(".", "/") + ".pyx", tuple(headers))
            for _tag, mod, headers in _native_literal("EXTENSIONS")]


#: module -> why it is left out ("" once built)
left_out: dict[str, str] = {}
HEADERS: dict[str, tuple[str, ...]] = {}


def _note(module: str, why: str) -> None:
    left_out[module] = why
    msg = f"aiordma: {module} is not compiled ({why}); its pure-Python path runs instead"
    if MODE == "compiled":
        raise SystemExit(msg + " [AIORDMA_BUILD=compiled]")
    print(msg, file=sys.stderr)


def _cython_ext_modules() -> list[Any]:
    exts = cython_extensions()
    if MODE == "python":
        for mod, _src, _h in exts:
            left_out[mod] = "AIORDMA_BUILD=python"
        return []
    try:
        from Cython.Build import cythonize
        from setuptools import Extension
    except ImportError as exc:
        for mod, _src, _h in exts:
            _note(mod, f"Cython is not installed: {exc}")
        return []
    out = []
    for mod, src, headers in exts:
        HEADERS[mod] = headers
        out.append(Extension(mod, [src]))
    return cythonize(out, compiler_directives={"language_level": 3}, quiet=True)


class BuildExt(build_ext):
    """Builds what can be built: a Cython extension whose headers do not compile, or
    that fails to compile, is left out (``_note``); records ``_build.json``."""

    def _headers_compile(self, headers: tuple[str, ...]) -> str:
        """"" when a C file including ``headers`` compiles, else the reason."""
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "probe.c")
            with open(src, "w") as f:
                f.writelines(f"#include <{h}>\n" for h in headers)
                f.write("int aiordma_probe(void) { return 0; }\n")
            try:
                self.compiler.compile([src], output_dir=tmp)
            except Exception as exc:  # CompileError, a missing compiler (spawn errors)
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                if headers:
                    return (f"{', '.join(headers)} does not compile or is missing ({first}; "
                            "Debian: apt install gcc libibverbs-dev)")
                return f"no working C compiler ({first})"
        return ""

    def build_extension(self, ext: Any) -> None:
        if ext.name not in HEADERS:  # mypyc's
            super().build_extension(ext)
            return
        why = self._headers_compile(HEADERS[ext.name])
        if why:
            _note(ext.name, why)
            return
        try:
            super().build_extension(ext)
        except Exception as exc:
            _note(ext.name, f"compiling it failed: {exc}")
            return
        left_out[ext.name] = ""

    def run(self) -> None:
        super().run()
        self._write_info()

    def _write_info(self) -> None:
        root = os.curdir if self.inplace else self.build_lib
        path = os.path.join(root, "aiordma", "_build.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"extensions": left_out}, f, indent=1, sort_keys=True)
            f.write("\n")


def ext_modules() -> list[Any]:
    """The extensions to build: the Cython ones, and mypyc's with ``AIORDMA_MYPYC=1``."""
    out = _cython_ext_modules()
    if os.environ.get("AIORDMA_MYPYC") == "1":
        from mypyc.build import mypycify

        # group "aiordma._native": one shared library, aiordma/_native__mypyc
        # (native.SHARED_LIB)
        out += mypycify(native_modules(), opt_level="3", group_name="aiordma._native")
    return out


def build_in_place() -> None:
    """``build_ext --inplace`` without reading pyproject.toml, whose metadata may need a
    newer setuptools than the one at hand (the Debian guests' python3-setuptools):
    ``python3 -c 'import setup; setup.build_in_place()'`` from the checkout."""
    from setuptools import Distribution

    dist = Distribution({"ext_modules": ext_modules(), "cmdclass": {"build_ext": BuildExt},
                         "script_name": "setup.py", "script_args": ["build_ext", "--inplace"]})
    dist.parse_command_line()
    dist.run_commands()


if __name__ == "__main__":  # (setuptools' build backend runs this file as __main__)
    setup(ext_modules=ext_modules(), cmdclass={"build_ext": BuildExt})
