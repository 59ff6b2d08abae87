"""The installed wheel as a user gets it (``make test-wheel``), run with the Python of a
fresh virtual environment that holds the wheel alone, from a directory outside the
checkout:

    python tests/wheel_check.py DIST_DIR CHECKOUT

Checks what the sdist and the wheel in DIST_DIR contain (the soft provider's compiled
data path and the mypyc modules where a C compiler is here, the compiled verbs data path
where rdma-core's headers are too), that ``aiordma`` is imported
from the environment (not the checkout) with its ``py.typed``, license and entry point,
then runs, each as a process with a time limit: ``aiordma doctor``, ``aiordma devices``,
``aiordma bench --help`` and a short bench, the examples of CHECKOUT/examples and the
README's quick start. Prints one line per check; exits 1 at the first failure.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

from _readme import section_code

import aiordma
from aiordma import native

TIMEOUT = 240
#: where rdma-core's headers are, the build compiles the verbs data path by default
VERBS_H = "/usr/include/infiniband/verbs.h"


def fail(msg: str) -> None:
    print(f"wheel check FAILED: {msg}", flush=True)
    sys.exit(1)


def check_archives(dist: pathlib.Path) -> None:
    wheels, sdists = list(dist.glob("aiordma-*.whl")), list(dist.glob("aiordma-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        fail(f"expected one wheel and one sdist in {dist}, found {wheels + sdists}")
    names = zipfile.ZipFile(wheels[0]).namelist()
    for want in ("aiordma/py.typed", "aiordma/bench/cli.py", "aiordma/doctor.py",
                 "aiordma/verbs/ibverbs/fastpath.pyx", "aiordma/verbs/ibverbs/fastpath.pxd",
                 "aiordma/verbs/soft/_core.pyx", "aiordma/verbs/soft/_core.pxd",
                 "aiordma/verbs/soft/_core.pyi", "aiordma/verbs/soft/core_qp.pxi",
                 "aiordma/protocol/engine.pyx", "aiordma/protocol/engine_sender.pxi"):
        if want not in names:
            fail(f"the wheel has no {want}")
    built = [n for n in names if re.fullmatch(r"aiordma/verbs/ibverbs/fastpath\..*\.so", n)]
    if os.path.exists(VERBS_H) and shutil.which("cc") and not built:
        fail(f"{VERBS_H} and a C compiler are here, but the wheel has no compiled data path")
    for ext in ("verbs/soft/_core", "protocol/engine"):
        if shutil.which("cc") and not any(re.fullmatch(rf"aiordma/{ext}\..*\.so", n)
                                          for n in names):
            fail(f"a C compiler is here, but the wheel has no aiordma/{ext} extension")
    lib = native.SHARED_LIB.replace(".", "/")
    if shutil.which("cc") and not any(re.fullmatch(rf"{lib}\..*\.so", n) for n in names):
        fail("a C compiler is here, but the wheel has no mypyc modules")
    if not any(re.fullmatch(r"aiordma-[^/]+\.dist-info/licenses/LICENSE", n) for n in names):
        fail("the wheel has no dist-info/licenses/LICENSE")
    stray = [n for n in names if n.split("/")[0] in ("tests", "examples", "docs")]
    if stray:
        fail(f"the wheel carries files outside the package: {stray[:5]}")
    with tarfile.open(sdists[0]) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    for want in ("LICENSE", "README.md", "aiordma/py.typed", "examples/echo_pair.py",
                 "aiordma/verbs/soft/core_conn.pxi",
                 "aiordma/verbs/ibverbs/fastpath_completions.pxi",
                 "docs/design.md", "tests/conftest.py"):
        if want not in members:
            fail(f"the sdist has no {want}")
    print(f"ok: {wheels[0].name} and {sdists[0].name} hold what they should", flush=True)


def check_installed(checkout: pathlib.Path) -> None:
    pkg = pathlib.Path(aiordma.__file__).resolve().parent
    if pkg == (checkout / "aiordma").resolve() or pathlib.Path(sys.prefix).resolve() not in pkg.parents:
        fail(f"aiordma was imported from {pkg}, not from this environment ({sys.prefix})")
    if not (pkg / "py.typed").is_file():
        fail("the installed package has no py.typed")
    meta = importlib.metadata.metadata("aiordma")
    if meta.get("License-Expression") != "MIT":
        fail(f"License-Expression is {meta.get('License-Expression')!r}, not 'MIT'")
    build = native.build()
    if os.path.exists(VERBS_H) and shutil.which("cc") and not build.compiled("verbs"):
        fail(f"a source install with a C compiler and {VERBS_H} runs {build}")
    if shutil.which("cc") and not (all(map(build.compiled, ("soft", "engine", "queues")))):
        fail(f"a source install with a C compiler runs {build}, without the engine or the "
             "soft data path")
    if shutil.which("cc") and build.modules != "mypyc":
        fail(f"a source install with a C compiler runs {build}, not the mypyc modules")
    print(f"ok: aiordma {aiordma.__version__} installed in {pkg}, typed, MIT, build {build}",
          flush=True)


def run(what: str, args: list[str], expect: str | None = None, env: dict[str, str] | None = None,
        cwd: pathlib.Path | None = None) -> str:
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT,
                           env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        fail(f"{what}: no result within {TIMEOUT} s")
    if r.returncode != 0 or (expect is not None and not re.search(expect, r.stdout, re.M)):
        fail(f"{what}: exit {r.returncode}\n{r.stdout}{r.stderr}")
    print(f"ok: {what}", flush=True)
    return r.stdout


def main() -> None:
    dist, checkout = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    if pathlib.Path.cwd().resolve() == checkout.resolve() or "PYTHONPATH" in os.environ:
        fail("run it outside the checkout, without PYTHONPATH")
    check_archives(dist)
    check_installed(checkout)
    script = pathlib.Path(sys.executable).with_name("aiordma")
    run("aiordma doctor", [str(script), "doctor", "--provider", "soft"],
        r"^verdict: OK: aiordma works here on soft")
    run("aiordma devices", [str(script), "devices"], r"mtu=4096")
    run("aiordma bench --help", [str(script), "bench", "--help"], r"--baselines")
    run("aiordma bench (short)", [str(script), "bench", "--tests", "send_lat,write_bw", "--sizes",
                                  "64,1M", "--iters", "20", "--warmup", "2", "--max-seconds", "5",
                                  "--baselines", "tcp-proto"], r"^Summary: ")
    ex = checkout / "examples"
    py = sys.executable
    run("examples/echo_pair.py", [py, str(ex / "echo_pair.py"), "--count", "20", "--size",
                                  "0,64,17K,1M"], r"^echo ok: .* 1048576 B")
    run("examples/rdma_read_write.py", [py, str(ex / "rdma_read_write.py"), "--size", "1M"],
        r"^rdma_read_write ok")
    run("examples/protocol_echo.py", [py, str(ex / "protocol_echo.py"), "--count", "10",
                                      "--size", "100K"], r"^protocol_echo ok")
    quick = section_code((checkout / "README.md").read_text(), "Quick start")
    pathlib.Path("quick_start.py").write_text(quick)
    out = run("the README's quick start", [py, "quick_start.py"])
    if out != "b'hello'\n0\n5\n":
        fail(f"the quick start printed {out!r}")
    print("wheel check: all passed", flush=True)


if __name__ == "__main__":
    main()
