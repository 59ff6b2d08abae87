"""Builds aiordma's mypyc group (``aiordma.native.MODULES``) and its Cython extensions
that need no system headers (``aiordma.native.EXTENSIONS`` without headers: the message
engine, the soft data path) on the host for a guest image's Python, so that the
Soft-RoCE guests run the compiled modules as a native install does. (The verbs data
path needs the guest's rdma-core headers: the guest builds that one, guest-build.sh.)

mypy (mypyc) and a C compiler under TCG would take longer than the guest's tests (the
group's C is ~16 MB), so the host does both halves for the guest:

1. mypyc translates the modules for the guest's C API version (the emitted C picks type
   slots and calling conventions by it: ``translate``); Cython's C serves every Python
   version it supports (``cythonize_extensions``: it took 14 minutes under TCG);
2. the host's C compiler builds the group's shared library and shims, and the Cython
   extensions, against the guest's own Python headers, read out of the image with
   ``debugfs`` (e2fsprogs; no mount, no root), with the guest's extension suffix
   (``.cpython-3XY-x86_64-linux-gnu.so``).

Extension modules do not link libpython, and the host's glibc is no newer than the
guests' (bookworm's 2.36), so what is built here loads there. guest-build.sh unpacks the
result in the guest's /project before it builds the Cython extensions, and fails unless
``aiordma.native.build()`` says every module runs compiled.

A build is kept in the cache directory per guest Python and inputs (the modules' sources,
the Cython sources, pyproject.toml, mypy's and Cython's versions, this file); a later
run with the same key reuses it.

Usage: python guest_mypyc.py ROOT_IMG CACHE_DIR OUT_TAR
Exit status 0 with OUT_TAR written; otherwise 1, with the reason on stderr.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any, NoReturn

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: kept builds per cache directory
KEEP = 3
#: what an extension's compile and link need beyond mypyc's own flags (CPython's
#: extension flags: position-independent, wrapping signed arithmetic)
CFLAGS = ["-pthread", "-fPIC", "-fwrapv", "-fno-strict-overflow", "-DNDEBUG"]
LDFLAGS = ["-pthread", "-shared"]
ARCH = "x86_64-linux-gnu"


def die(msg: str) -> NoReturn:
    print(f"guest_mypyc: {msg}", file=sys.stderr)
    raise SystemExit(1)


def debugfs(img: str, request: str) -> str:
    """``debugfs -R request img``'s output (read-only: no mount, no root)."""
    done = subprocess.run(["debugfs", "-R", request, img], capture_output=True, text=True)
    if done.returncode != 0:
        die(f"debugfs -R {request!r} {img}: {done.stderr.strip()}")
    return done.stdout


def guest_python(img: str) -> tuple[int, int]:
    """The guest's ``python3`` as (3, minor): the target of /usr/bin/python3's link."""
    out = debugfs(img, "stat /usr/bin/python3")
    m = re.search(r'Fast link dest: "python3\.(\d+)"', out)
    if not m:
        die(f"{img}: /usr/bin/python3 is not a link to python3.N ({out.strip()[:200]})")
    return 3, int(m.group(1))


def extract_headers(img: str, ver: tuple[int, int], dest: str) -> list[str]:
    """The guest's Python headers under ``dest``; returns the include directories (Debian
    keeps pyconfig.h per architecture, behind a <ARCH/python3.N/pyconfig.h> wrapper)."""
    py = f"python{ver[0]}.{ver[1]}"
    inc = os.path.join(dest, "include")
    os.makedirs(os.path.join(inc, ARCH))
    debugfs(img, f"rdump /usr/include/{py} {inc}")
    debugfs(img, f"rdump /usr/include/{ARCH}/{py} {os.path.join(inc, ARCH)}")
    for need in (os.path.join(inc, py, "Python.h"), os.path.join(inc, ARCH, py, "pyconfig.h")):
        if not os.path.exists(need):
            die(f"{img}: no {os.path.relpath(need, inc)} in the guest (python3-dev)")
    return [os.path.join(inc, py), inc]


def repo_setup() -> ModuleType:
    """The repository's setup.py as a module (``native_modules()`` reads
    aiordma/native.py; ``MYPYC_GROUP``)."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import setup
    return setup


def cython_sources() -> list[tuple[str, str]]:
    """``(module, .pyx path)`` of the Cython extensions that need no system headers."""
    return [(mod, src) for mod, src, headers in repo_setup().cython_extensions() if not headers]


def cython_inputs(pyx: list[str]) -> list[str]:
    """Every file the Cython extensions ``pyx`` are made of (their .pyx, .pxd, .pxi)."""
    out = []
    for src in pyx:
        d = os.path.dirname(src)
        out += [os.path.join(d, f) for f in os.listdir(os.path.join(REPO, d))
                if f.endswith((".pyx", ".pxd", ".pxi"))]
    return sorted(set(out))


def cache_key(ver: tuple[int, int], sources: list[str]) -> str:
    import Cython
    import mypy.version
    h = hashlib.sha256(f"{ver} {mypy.version.__version__} {Cython.__version__}\n".encode())
    for path in sorted(sources) + ["pyproject.toml", os.path.relpath(__file__, REPO)]:
        with open(os.path.join(REPO, path), "rb") as f:
            h.update(path.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:16]


def translate(ver: tuple[int, int], sources: list[str], build_dir: str) -> list[Any]:
    """mypyc's extensions (the group's library first, then a shim per module) for C API
    ``ver``, their C written under ``build_dir``.

    mypyc takes the C API version it emits for from ``sys.version_info[:2]`` of the
    interpreter it runs in, read at translation time (``CompilerOptions.capi_version``,
    and every ``Emitter``'s, which is not an argument anywhere): the translation runs with
    ``sys.version_info`` set to the guest's. The comparisons with ``sys.version_info``
    inside mypy and mypyc are folded when mypy itself is compiled (the wheels are), so
    they keep the host's version; the ones that matter to the emitted C (the managed
    ``__dict__`` and type slots of 3.12+, fast calls) go by ``capi_version``. Whatever
    would not fit the guest's headers fails the compile (mypyc's flags include -Werror),
    and guest-build.sh imports every module in the guest.
    """
    import collections

    import mypyc.build as mb

    # (a cache of its own: mypyc skips writing C that an earlier run of the same
    # modules wrote, into whichever directory that was)
    os.environ["MYPY_CACHE_DIR"] = os.path.join(build_dir, ".mypy_cache")
    real = sys.version_info
    fake = collections.namedtuple("version_info", "major minor micro releaselevel serial")
    sys.version_info = fake(ver[0], ver[1], 0, "final", 0)  # type: ignore[misc,assignment]
    try:
        return list(mb.mypycify(sources, opt_level="3", group_name=repo_setup().MYPYC_GROUP,
                                target_dir=build_dir))
    finally:
        sys.version_info = real  # type: ignore[misc]


def cythonize_extensions(build_dir: str) -> list[Any]:
    """The header-less Cython extensions as setuptools extensions whose sources are the C
    that Cython wrote under ``build_dir``."""
    from Cython.Build import cythonize
    from setuptools import Extension

    exts = [Extension(mod, [src], extra_compile_args=["-O2"]) for mod, src in cython_sources()]
    if not exts:
        return []
    return list(cythonize(exts, build_dir=os.path.join(build_dir, "cython"), quiet=True,
                          compiler_directives={"language_level": 3}))


def compile_group(exts: list[Any], includes: list[str], suffix: str, build_dir: str,
                  out_dir: str) -> list[str]:
    """Compiles and links each extension for the guest; returns the built paths relative
    to ``out_dir``."""
    cc = shlex.split(os.environ.get("CC", "cc"))
    jobs: list[tuple[list[str], str]] = []
    objects: dict[str, list[str]] = {}
    objs = os.path.join(build_dir, "obj")
    os.makedirs(objs)
    for ext in exts:
        objects[ext.name] = []
        for src in ext.sources:
            obj = os.path.join(objs, f"{len(jobs)}.o")
            incs = [f"-I{d}" for d in list(ext.include_dirs) + includes]
            jobs.append((cc + CFLAGS + list(ext.extra_compile_args) + incs
                         + ["-c", src, "-o", obj], src))
            objects[ext.name].append(obj)

    def run(job: tuple[list[str], str]) -> str:
        done = subprocess.run(job[0], cwd=REPO, capture_output=True, text=True)
        return "" if done.returncode == 0 else f"{job[1]}: {done.stderr.strip()[-2000:]}"

    # the library's C first: it is by far the longest
    jobs.sort(key=lambda j: -os.path.getsize(os.path.join(REPO, j[1])))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        errors = [e for e in pool.map(run, jobs) if e]
    if errors:
        die("compiling the C for the guest failed: " + errors[0])
    built = []
    for ext in exts:
        rel = ext.name.replace(".", "/") + suffix
        path = os.path.join(out_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        done = subprocess.run(cc + LDFLAGS + objects[ext.name] + ["-o", path],
                              capture_output=True, text=True)
        if done.returncode != 0:
            die(f"linking {rel} failed: {done.stderr.strip()[-2000:]}")
        built.append(rel)
    return built


def build(img: str, ver: tuple[int, int], sources: list[str], tar_path: str) -> None:
    suffix = f".cpython-{ver[0]}{ver[1]}-{ARCH}.so"
    with tempfile.TemporaryDirectory(prefix="aiordma-guest-mypyc.") as tmp:
        includes = extract_headers(img, ver, os.path.join(tmp, "guest"))
        build_dir = os.path.join(tmp, "build")
        exts = translate(ver, sources, build_dir) + cythonize_extensions(build_dir)
        out = os.path.join(tmp, "out")
        built = compile_group(exts, includes, suffix, build_dir, out)
        tmp_tar = f"{tar_path}.{os.getpid()}.tmp"  # (two guests may build at once)
        with tarfile.open(tmp_tar, "w") as tar:
            for rel in built:
                tar.add(os.path.join(out, rel), arcname=rel)
        os.replace(tmp_tar, tar_path)


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    img, cache, out = argv[1:]
    os.environ["PATH"] += os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    if shutil.which("debugfs") is None:
        die("debugfs (e2fsprogs) is missing")
    try:
        import mypyc  # noqa: F401
    except ImportError as exc:
        die(f"mypy (mypyc) is not installed for {sys.executable}: {exc}")
    ver = guest_python(img)
    sources = list(repo_setup().native_modules())
    cython_files = cython_inputs([src for _mod, src in cython_sources()])
    os.chdir(REPO)  # mypyc reads pyproject.toml's settings and the module paths from here
    key = cache_key(ver, sources + cython_files)
    kept = os.path.join(cache, f"mypyc-{key}.tar")
    if not os.path.exists(kept):
        os.makedirs(cache, exist_ok=True)
        build(img, ver, sources, kept)
        old = sorted((p for p in os.listdir(cache) if p.startswith("mypyc-")),
                     key=lambda p: -os.path.getmtime(os.path.join(cache, p)))
        for p in old[KEEP:]:
            os.unlink(os.path.join(cache, p))
        print(f"guest_mypyc: built the mypyc modules and the Cython extensions without "
              f"system headers for Python {ver[0]}.{ver[1]}: {kept}", file=sys.stderr)
    else:
        os.utime(kept)
        print(f"guest_mypyc: reusing the kept mypyc build for Python {ver[0]}.{ver[1]}: "
              f"{kept}", file=sys.stderr)
    shutil.copyfile(kept, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
