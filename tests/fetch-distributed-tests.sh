#!/usr/bin/env bash
# Fetch distributed's own test modules (which its PyPI wheel and sdist leave out) from
# Debian's python3-distributed package, which ships them, into DEST:
#   DEST/distributed/comm/tests/test_comms.py   the generic comm checks
#   DEST/distributed/tests/*.pem                 the TLS certificates it loads at import
# tests/test_dask_comms.py imports the checks from there (or from an installed
# distributed that has them) and runs them against rdma://.
#
#   tests/fetch-distributed-tests.sh DEST
#
# Uses apt-get with a private configuration (the host's apt setup is not touched), so it
# works on any Debian/Ubuntu host with apt-get; exits non-zero when it cannot.
# AIORDMA_DASK_TESTS_SUITE (default forky: the Soft-RoCE guests' Debian) picks the
# release; AIORDMA_RXE_MIRROR the mirror, as for the VM images.
set -euo pipefail
dest=${1:?usage: fetch-distributed-tests.sh DEST}
suite=${AIORDMA_DASK_TESTS_SUITE:-forky}
mirror=${AIORDMA_RXE_MIRROR:-http://deb.debian.org/debian}
command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null \
    || { echo "fetch-distributed-tests: needs apt-get and dpkg-deb" >&2; exit 69; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/x"
echo "deb $mirror $suite main" > "$tmp/sources.list"
apt=(apt-get -q -o "Dir::Etc::sourcelist=$tmp/sources.list" -o "Dir::Etc::sourceparts=-"
     -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o "APT::Sandbox::User=$(id -un)"
     -o "Acquire::http::Timeout=30" -o "Acquire::Retries=2")
"${apt[@]}" update >"$tmp/log" 2>&1 || { cat "$tmp/log" >&2; exit 75; }
(cd "$tmp" && "${apt[@]}" download python3-distributed) >>"$tmp/log" 2>&1 \
    || { cat "$tmp/log" >&2; exit 75; }
dpkg-deb -x "$tmp"/python3-distributed_*.deb "$tmp/x"
src="$tmp/x/usr/lib/python3/dist-packages/distributed"
[ -f "$src/comm/tests/test_comms.py" ] \
    || { echo "fetch-distributed-tests: the package has no comm/tests/test_comms.py" >&2; exit 70; }
mkdir -p "$dest/distributed/comm/tests" "$dest/distributed/tests"
cp "$src/comm/tests/test_comms.py" "$dest/distributed/comm/tests/"
cp "$src"/tests/*.pem "$dest/distributed/tests/"
version=$(dpkg-deb -f "$tmp"/python3-distributed_*.deb Version)
echo "python3-distributed $version ($suite)" > "$dest/VERSION"
echo "fetch-distributed-tests: distributed's comm tests from python3-distributed $version ($suite) in $dest"
