#!/bin/bash
# Builds aiordma's Cython extensions (aiordma.native.EXTENSIONS) in the guest, in place in
# /project (its RAM overlay), for the guest's Python against the guest's rdma-core headers;
# run by guest-init.sh before the command. Every extension must build
# (AIORDMA_BUILD=compiled) and the compiled verbs path must import, or this fails. The C
# files cythonize would reuse (a host build's) go first: the guest's Cython writes its own.
# A build the host kept for these sources and this image (run-vm.sh: /run/rxectl/native.tar)
# is installed instead when it passes the same import check; after a build of its own the
# guest leaves RESULTS_DIR/native.tar for the host to keep.
# The mypyc modules (aiordma.native.MODULES) and the Cython extensions that need no
# system headers (the message engine, the soft data path) come built: run-vm.sh builds
# them on the host for this image's Python (tests/rxe/guest_mypyc.py: mypyc, Cython and a
# C compiler under TCG would take longer than the tests) and offers them as
# /run/rxectl/mypyc.tar; the guest then builds the verbs extension only, and what the
# host built, installed last, must all import compiled. Without that file the guest
# builds every Cython extension itself and the mypyc modules run as sources.
# Usage: guest-build.sh RESULTS_DIR (the build log is left there as build.log).
set -u
results=${1:-/tmp}
kept=/run/rxectl/native.tar
mypyc=/run/rxectl/mypyc.tar
cd /project || exit 1
: > "$results/build.log"

# check: the compiled verbs path imports (and what aiordma.native says of the build)
check() {
    python3 -c 'import sys, aiordma.native as n; b = n.build(); print("aiordma-rxe: aiordma build:", b); sys.exit(not b.compiled("verbs"))' \
        2>&1 | tee -a "$results/build.log"
    [ "${PIPESTATUS[0]}" = 0 ]
}

# cython_build: the Cython extensions, kept or built (native.tar for the host: these only)
cython_build() {
    if [ -s "$kept" ]; then
        # (-m: the files get the time of extraction, newer than this checkout's sources, which
        # the key says they were built from; aiordma.native.stale_modules compares the times)
        if tar -xmf "$kept" -C /project >> "$results/build.log" 2>&1 && { [ -s "$mypyc" ] || check; }; then
            echo "aiordma-rxe: installed the kept build of these sources (run-vm.sh's native cache)" \
                | tee -a "$results/build.log"
            return 0
        fi
        echo "aiordma-rxe: the kept build does not import here: building" | tee -a "$results/build.log"
        find aiordma -name '*.so' -delete
    fi

    find aiordma -name '*.pyx' | while read -r pyx; do rm -f "${pyx%.pyx}.c"; done
    rm -f aiordma/_build.json
    start=$SECONDS
    # (build_in_place: the guest's setuptools may be older than pyproject.toml's metadata needs;
    # AIORDMA_MYPYC=0: the guests have no mypy, and mypyc under emulation would take longer
    # than their tests -- the host builds the mypyc modules for them: mypyc_install)
    only=
    [ -s "$mypyc" ] && only=verbs  # (the host built the others: mypyc_install)
    if ! AIORDMA_BUILD=compiled AIORDMA_MYPYC=0 AIORDMA_EXTENSIONS=$only \
            python3 -c 'import setup; setup.build_in_place()' >> "$results/build.log" 2>&1; then
        tail -n 40 "$results/build.log"
        return 1
    fi
    # (aiordma imports only with the engine: with the host's build, mypyc_install checks)
    [ -s "$mypyc" ] || check || return 1
    echo "aiordma-rxe: built the Cython extensions in $((SECONDS - start)) s (Cython $(python3 -c 'import Cython; print(Cython.__version__)'))" \
        | tee -a "$results/build.log"
    # for the host to keep: the extensions and the build record, paths relative to /project
    find aiordma -name '*.so' -print0 | tar -cf "$results/native.tar" --null -T - aiordma/_build.json \
        2>> "$results/build.log" || rm -f "$results/native.tar"
}

# mypyc_install: the host's build of the mypyc modules for this Python, if offered
mypyc_install() {
    if [ ! -s "$mypyc" ]; then
        echo "aiordma-rxe: no mypyc build offered by the host: the mypyc modules run as sources" \
            | tee -a "$results/build.log"
        return 0
    fi
    tar -xmf "$mypyc" -C /project >> "$results/build.log" 2>&1 || return 1
    # the build record: what the host built is compiled (the guest's own build left it out)
    python3 -c 'import json, sys, tarfile; p = "aiordma/_build.json"; d = json.load(open(p)); mods = ["aiordma._native"] + [m.name.split(".cpython-")[0].replace("/", ".") for m in tarfile.open(sys.argv[1]) if not m.name.startswith("aiordma/_native")]; d["extensions"].update((m, "") for m in mods if m == "aiordma._native" or m in d["extensions"]); json.dump(d, open(p, "w"), indent=1, sort_keys=True)' \
        "$mypyc" >> "$results/build.log" 2>&1 || return 1
    python3 -c 'import sys, aiordma.native as n; b = n.build(); print("aiordma-rxe: with the host-built modules:", b); sys.exit(b.modules != "mypyc" or any(b.extensions.values()))' \
        2>&1 | tee -a "$results/build.log"
    [ "${PIPESTATUS[0]}" = 0 ]
}

cython_build || exit 1
mypyc_install || exit 1
