"""aiordma's compiled modules; the pure-Python sources always work alone.

Cython (``aiordma.native.EXTENSIONS``): built by default -- ``pip install .``, ``python
setup.py build_ext --inplace`` (``make native``) -- where a C compiler, Cython and the C
headers each module needs are found. A module whose compiler, Cython or headers are
missing, or that fails to compile, is left out: its pure-Python path runs instead, and
the build says why on stderr and in ``aiordma/_build.json`` (``aiordma.native.build()``
reads it).

mypyc (``aiordma.native.MODULES``, one group: ``aiordma._native__mypyc`` and a shim per
module): built by default too where mypy (mypyc) is installed -- a build requirement in
pyproject.toml, so ``pip install`` has it -- and a C compiler works. The group is all or
nothing: if mypyc cannot translate the modules or its C does not compile, none of them is
compiled, the sources run, and ``_build.json`` says why. ``AIORDMA_MYPYC``: ``auto`` (the
default, as above), ``1`` (required: the build fails without it; ``make native``) or
``0`` (never).

``AIORDMA_BUILD``: ``auto`` (the default, as above), ``python`` (compile nothing), or
``compiled`` (every Cython extension, or the build fails: ``make native``, the VM tier).
``AIORDMA_EXTENSIONS``: a comma-separated list of the Cython extensions' tags to build
(default: all); the others are left out, saying so (the Soft-RoCE guests build the
``verbs`` one only: the host builds the others for them, ``tests/rxe/guest_mypyc.py``).
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
MYPYC = os.environ.get("AIORDMA_MYPYC", "auto")
ONLY = os.environ.get("AIORDMA_EXTENSIONS") or None  # (empty: all)
if MYPYC not in ("auto", "0", "1"):
    raise SystemExit(f"AIORDMA_MYPYC={MYPYC!r}: use auto, 0 or 1")
#: the mypyc group's key in ``left_out`` and ``_build.json`` (aiordma.native.MYPYC_GROUP)
MYPYC_GROUP = "aiordma._native"


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


def cython_extensions(tags: bool = False) -> list[tuple[str, str, tuple[str, ...]]]:
    """``aiordma.native.EXTENSIONS`` as ``(module, .pyx source path, headers)``; with
    ``tags``, ``(tag, module, source, headers)``."""
    return [((tag,) if tags else ()) + (mod, mod.replace(".", "/") + ".pyx", tuple(headers))
            for tag, mod, headers in _native_literal("EXTENSIONS")]


#: the commands that compile (a command line with none of them, e.g. sdist, compiles nothing)
BUILD_COMMANDS = frozenset({"build", "build_ext", "bdist", "bdist_wheel", "bdist_egg",
                            "install", "develop", "editable_wheel"})

#: module -> why it is left out ("" once built)
left_out: dict[str, str] = {}
HEADERS: dict[str, tuple[str, ...]] = {}


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _note(module: str, why: str) -> None:
    left_out[module] = why
    if module == MYPYC_GROUP:
        msg = (f"aiordma: the mypyc modules are not compiled ({why}); their Python sources "
               "run instead")
        if MYPYC == "1":
            raise SystemExit(msg + " [AIORDMA_MYPYC=1]")
    else:
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
    only = None if ONLY is None else {t.strip() for t in ONLY.split(",") if t.strip()}
    for tag, mod, src, headers in cython_extensions(tags=True):
        if only is not None and tag not in only:
            left_out[mod] = f"AIORDMA_EXTENSIONS={ONLY}"
            continue
        HEADERS[mod] = headers
        out.append(Extension(mod, [src]))
    if not out:
        return []
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
                first = _first_line(exc)
                if headers:
                    return (f"{', '.join(headers)} does not compile or is missing ({first}; "
                            "Debian: apt install gcc libibverbs-dev)")
                return f"no working C compiler ({first})"
        return ""

    def build_extension(self, ext: Any) -> None:
        if ext.name not in HEADERS:  # mypyc's (_build_mypyc_group)
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

    def build_extensions(self) -> None:
        """Each Cython extension on its own, then the mypyc group, all or nothing: its
        shared library first, then the shims (a shim without the library would fail to
        import); if any fails, what the group built is removed. What is left out is
        dropped from the list, so that nothing copies or installs it."""
        self.check_extensions_list(self.extensions)
        group = [e for e in self.extensions if e.name not in HEADERS]
        for ext in self.extensions:
            if ext.name in HEADERS:
                self.build_extension(ext)
        if group:
            self._build_mypyc_group(group)
        self.extensions = [e for e in self.extensions
                           if left_out.get(e.name if e.name in HEADERS else MYPYC_GROUP) == ""]

    def _build_mypyc_group(self, group: list[Any]) -> None:
        built: list[str] = []
        try:
            for ext in group:
                self.build_extension(ext)
                built.append(self.get_ext_fullpath(ext.name))
        except Exception as exc:
            for path in built:
                if os.path.exists(path):
                    os.unlink(path)
            _note(MYPYC_GROUP, f"compiling mypyc's C failed: {_first_line(exc)}")
            return
        left_out[MYPYC_GROUP] = ""

    def finalize_options(self) -> None:
        # mypyc's group joins the list here, where build_ext prepares each extension --
        # only when something builds: sdist finalizes this command too (for the sources
        # it would ship), and must neither wait for mypyc nor ship the C it writes
        if BUILD_COMMANDS & set(getattr(self.distribution, "commands", None) or ()):
            self.distribution.ext_modules = (list(self.distribution.ext_modules or [])
                                             + _mypyc_ext_modules())
        super().finalize_options()

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
    """The Cython extensions to build (``BuildExt.finalize_options`` adds mypyc's group:
    translating the modules takes a while, and only a build needs it)."""
    return _cython_ext_modules()


def _mypyc_ext_modules() -> list[Any]:
    """mypyc's group (``native.MODULES``) as extensions, or none, with the reason
    noted: ``AIORDMA_MYPYC=0`` or ``AIORDMA_BUILD=python``, mypy missing, or the
    modules failing mypyc's type check."""
    if MODE == "python" or MYPYC == "0":
        left_out[MYPYC_GROUP] = "AIORDMA_BUILD=python" if MODE == "python" else "AIORDMA_MYPYC=0"
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        _note(MYPYC_GROUP, f"mypy (mypyc) is not installed: {exc}")
        return []
    try:
        # one shared library, aiordma/_native__mypyc (native.SHARED_LIB), and a shim per
        # module
        return list(mypycify(native_modules(), opt_level="3", group_name=MYPYC_GROUP))
    except (Exception, SystemExit) as exc:  # mypyc exits on a type error
        _note(MYPYC_GROUP, f"mypyc could not translate the modules: {exc}")
        return []


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
