# aiordma — everything a fresh machine needs goes through these targets.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SIZES ?= 0,64,4K,1M,64M
COUNT ?= 200

_NATIVE_SO = $(wildcard aiordma/*.so aiordma/*/*.so aiordma/*/*/*.so)
# what cythonize writes next to each .pyx
_NATIVE_C = $(patsubst %.pyx,%.c,$(wildcard aiordma/*/*/*.pyx aiordma/*/*.pyx aiordma/*.pyx))


.PHONY: bench-cost bench-ucxx
.PHONY: core core-prereqs native native-prereqs clean-native test-native test-wheel results setup echo test test-fast test-net net-prereqs bench-net test-rxe test-rxe-all test-rxe-bookworm test-rxe-compat test-rxe-two lint bench bench-rxe clean

$(VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 'setuptools>=77'
	AIORDMA_BUILD=python $(PY) -m pip install -q -e '.[test]'
	touch $@

# distributed's comm test module (tests/test_dask_comms.py runs its generic checks
# against rdma://): pip's wheels leave it out, Debian's python3-distributed ships it.
# Fetched once; without it (no apt-get, no mirror) those tests skip, saying why.
DIST_TESTS := $(VENV)/distributed-tests
$(DIST_TESTS)/VERSION: tests/fetch-distributed-tests.sh | $(VENV)/.stamp
	bash tests/fetch-distributed-tests.sh $(DIST_TESTS) \
		|| echo "make: distributed's comm tests not fetched; tests/test_dask_comms.py skips them"

setup: $(VENV)/.stamp $(DIST_TESTS)/VERSION core

## The Cython extensions, in place (make clean-native removes them): the message engine
## (aiordma.protocol.engine), the soft provider's data path (aiordma.verbs.soft._core) and
## the verbs provider's queue accounting (aiordma.verbs.ibverbs.queues), which aiordma
## needs, and the verbs data path where rdma-core's headers are. build_ext
## recompiles only what changed; the mypyc modules stay as they are (make native).
core: $(VENV)/.stamp core-prereqs
	@mkdir -p build
	AIORDMA_MYPYC=0 $(abspath $(PY)) setup.py -q build_ext --inplace >build/core.log 2>&1 \
		|| { tail -30 build/core.log; exit 1; }
	@$(PY) -c "import aiordma.native as n; b = n.build(); \
		raise SystemExit(None if all(map(b.compiled, ('soft', 'engine', 'queues'))) \
		else f'make core: the engine, the soft data path or the queues did not build: {b}')"

## The main job: async echo across two processes on the soft provider.
echo: setup
	AIORDMA_PROVIDER=soft $(PY) examples/echo_pair.py --count $(COUNT) --size $(SIZES)

## Fast tier: unit, sans-IO and provider-parametrised tests on `soft`, both loops,
## plus mypy and ruff (the two-host tests are test-net's): the Python modules as
## sources (the mypyc ones uncompiled), the Cython extensions built (make core).
test-fast: setup
	AIORDMA_PROVIDER=soft $(PY) -m pytest -q -m "not netns"

## Two hosts on this machine (network namespaces joined by a veth pair, root): `soft`
## over TCP between them, the endpoint API, traffic under loss/delay/reordering/
## duplication, and the faults a network has (link down, total loss, paused, killed
## and vanished peers), with the figures they measured printed at the end.
test-net: setup net-prereqs
	AIORDMA_PROVIDER=soft $(PY) -m pytest -q -rs -m netns

# iproute2 (ip netns) and iptables, installed with apt-get when missing (as root).
net-prereqs:
	@if ! command -v ip >/dev/null 2>&1 || ! command -v iptables >/dev/null 2>&1; then \
		command -v apt-get >/dev/null 2>&1 || { echo "make test-net: needs iproute2 and iptables"; exit 1; }; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq iproute2 iptables; \
	fi

## The test command (README, .ci/run): the fast tier (the pure-Python sources), the
## two-host tier, the fast tier again on the native build (Cython extensions and mypyc),
## the package as a user installs it, then the same suite on real verbs (rdma_rxe, the
## Cython extensions built in the guest) inside the Soft-RoCE VM: forky (pyverbs 65),
## then the compat run on bookworm (44).
test: test-fast test-net test-native test-wheel test-rxe test-rxe-compat

lint: setup
	$(PY) -m ruff check aiordma tests examples
	$(PY) -m mypy

clean: clean-native
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

## The native build (setup.py), in place: the Cython extensions (aiordma.native.EXTENSIONS:
## the soft device's data path, the verbs one through libibverbs) and the modules mypyc
## compiles (aiordma.native.MODULES). Python imports the extensions instead of the sources
## until `make clean-native`. (`make setup` installs the sources and builds the Cython
## extensions, `make core`; a plain `pip install` builds everything it can.)
# A C compiler and the headers of the venv's Python; installed with apt-get when missing.
core-prereqs:
	@if ! command -v cc >/dev/null 2>&1 \
		|| ! $(PYTHON) -c 'import os, sys, sysconfig; \
		sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then \
		command -v apt-get >/dev/null 2>&1 || { echo "make core: needs a C compiler and Python's headers"; exit 1; }; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq gcc python3-dev; \
	fi

# rdma-core's headers (libibverbs-dev) too; installed with apt-get when missing.
native-prereqs: core-prereqs
	@if [ ! -e /usr/include/infiniband/verbs.h ]; then \
		command -v apt-get >/dev/null 2>&1 || { echo "make native: needs rdma-core's headers (libibverbs-dev)"; exit 1; }; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq libibverbs-dev; \
	fi

# Compile every extension (AIORDMA_BUILD=compiled: one that cannot be built fails the
# build) in place, in the current directory's tree.
BUILD_NATIVE = AIORDMA_BUILD=compiled AIORDMA_MYPYC=1 $(abspath $(PY)) setup.py -q build_ext --inplace
# what `aiordma.native.build()` must report on the native build
NATIVE_TAGS = mypyc,verbs,soft,engine,queues

native: setup native-prereqs
	$(BUILD_NATIVE)
	$(PY) -c "import aiordma.native as n; b = n.build(); print('aiordma build:', b); \
		raise SystemExit(not set('$(NATIVE_TAGS)'.split(',')) <= b.tags)"

clean-native:
	rm -rf build $(_NATIVE_SO) aiordma/_build.json $(_NATIVE_C)

## The fast tier on the native build, in a copy of the working tree (build/native-tree)
## so that this tree stays as it is; lint ran in test-fast.
NATIVE_TREE := build/native-tree
test-native: setup native-prereqs
	rm -rf $(NATIVE_TREE) && mkdir -p $(NATIVE_TREE)
	tar --exclude=./.venv --exclude=./.git --exclude=./build --exclude='*.so' \
		--exclude=./aiordma/_build.json -cf - . \
		| tar -xf - -C $(NATIVE_TREE)
	cd $(NATIVE_TREE) && $(BUILD_NATIVE) >build.log 2>&1 || { tail -50 build.log; exit 1; }
	cd $(NATIVE_TREE) && AIORDMA_PROVIDER=soft AIORDMA_EXPECT_BUILD=$(NATIVE_TAGS) \
		AIORDMA_DISTRIBUTED_TESTS=$(abspath $(DIST_TESTS)) \
		$(abspath $(PY)) -m pytest -q -p no:cacheprovider -m "not lint and not netns"

## The package as a user gets it: build the sdist and, from it, the wheel (build/dist),
## install the wheel alone into a fresh venv (build/wheel-venv, no index, no checkout on
## its path), then, from an empty directory, check what it installed and run the
## examples, the README's quick start, aiordma doctor and a short aiordma bench with it
## (tests/wheel_check.py).
DIST := build/dist
WHEEL_VENV := build/wheel-venv
test-wheel: setup
	rm -rf $(DIST) $(WHEEL_VENV) && mkdir -p $(DIST)
	$(PY) -m build --outdir $(DIST) . >build/dist.log 2>&1 || { tail -30 build/dist.log; exit 1; }
	@! grep -i 'license.*deprecated' build/dist.log || { echo "test-wheel: the license metadata is deprecated"; exit 1; }
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q --no-index $(DIST)/aiordma-*.whl
	d=$$(mktemp -d) && cd "$$d" && env -u PYTHONPATH AIORDMA_PROVIDER=soft \
		$(abspath $(WHEEL_VENV))/bin/python $(CURDIR)/tests/wheel_check.py $(abspath $(DIST)) $(CURDIR); \
		rc=$$?; rm -rf "$$d"; exit $$rc

## Soft-RoCE VM tier (tests/rxe/README.md): the suite on real verbs (rdma_rxe) in a
## throw-away Debian VM under qemu. forky: rdma-core/pyverbs 65; bookworm: 44.
# The provider-parametrised suite (the provider-independent tests ran in the fast tier):
# the verbs layer (its compiled data path built in the guest, and required: the build
# tests), endpoints, EOF/close and the multi-process tests on both loops; the
# layers above the endpoint (Transports/Protocols, streams, the examples as separate
# processes, one device shared by loops in threads, the aiordma command, the README's
# code, the Dask backend with Debian's python3-distributed) on uvloop only -- they use
# nothing of the provider but the endpoint, and the fast tiers run them on both loops.
# (Both loops everywhere took 12 min of CI's ~31 on a slow host; `make test-rxe-all`
# runs it.)
RXE_TESTS ?= tests/test_verbs_provider.py tests/test_ibverbs_compat.py tests/test_endpoint.py \
	tests/test_endpoint_eof.py tests/test_send_many.py tests/test_multiprocess.py tests/test_ibverbs_fastpath.py \
	tests/test_native.py
RXE_TESTS_ONE_LOOP ?= tests/test_rdma_transport.py tests/test_streams.py \
	tests/test_examples_protocols.py tests/test_device_threads.py tests/test_cli.py \
	tests/test_docs.py tests/test_dask_comms.py tests/test_dask_cluster.py tests/test_bench_cost.py
RXE_PYTEST = python3 -m pytest -p no:cacheprovider -q -rfEs --durations=10
RXE_BOTH = -k "not tcp"
# (pytest-asyncio marks every async test "asyncio": those run on uvloop only, the rest
# (synchronous tests, examples as processes) as usual)
# (distributed's check_client_server on rdma://, 21 connections at once, takes 4-5 min
# in the emulated guest, twice: the fast tier runs it; the rest of the Dask tests run here)
RXE_UVLOOP = -k "not tcp and not client_server and (uvloop or not asyncio)"
# the guests run the mypyc modules compiled: the host builds them for the guest's Python
# (tests/rxe/guest_mypyc.py, with the venv's mypy), and a failure fails the run
export AIORDMA_GUEST_MYPYC ?= 1
export AIORDMA_RXE_HOST_PYTHON ?= $(abspath $(PY))

test-rxe: setup
	bash tests/rxe/run-vm.sh -- bash -c '$(RXE_PYTEST) $(RXE_BOTH) $(RXE_TESTS) \
		&& $(RXE_PYTEST) $(RXE_UVLOOP) $(RXE_TESTS_ONE_LOOP)'

test-rxe-all: setup
	bash tests/rxe/run-vm.sh -- $(RXE_PYTEST) $(RXE_BOTH) $(RXE_TESTS) $(RXE_TESTS_ONE_LOOP)

test-rxe-bookworm: setup
	AIORDMA_RXE_SUITE=bookworm bash tests/rxe/run-vm.sh -- $(RXE_PYTEST) $(RXE_BOTH) \
		$(RXE_TESTS) $(RXE_TESTS_ONE_LOOP)

# CI's compatibility run on rdma-core/pyverbs 44 (bookworm): the files that exercise the
# verbs layer (where 44 and 65 differ) -- the provider, its compat shims, endpoints and
# the multi-process examples -- on uvloop (which loop drives it is not where 44 and 65
# differ); `make test-rxe-bookworm` runs everything there.
RXE_COMPAT_TESTS = tests/test_verbs_provider.py tests/test_ibverbs_compat.py \
	tests/test_endpoint.py tests/test_multiprocess.py tests/test_ibverbs_fastpath.py \
	tests/test_native.py
test-rxe-compat: setup
	AIORDMA_RXE_SUITE=bookworm bash tests/rxe/run-vm.sh -- $(RXE_PYTEST) $(RXE_UVLOOP) \
		$(RXE_COMPAT_TESTS)

## verbs between two hosts: two Soft-RoCE guests (forky) joined by one Ethernet link
## (tests/rxe/run-two-vms.sh), a MTU 9000 and b 2500; b runs tests/test_rxe_two_hosts.py
## against a server on a: the endpoint API, the GID and path MTU each side picks, a peer
## killed with operations pending, an unreachable peer GID, bulk-transfer figures. Not
## in `make test` (CI time): 3 to 5 minutes on a 2-core host (both guests boot at once,
## about 45 s; the tests 2 to 4 minutes).
test-rxe-two: setup
	bash tests/rxe/run-two-vms.sh

## Benchmarks (docs/benchmarks.md): aiordma on the soft provider side by side with
## asyncio TCP/Unix sockets and a memcpy ceiling, measured in the same run; a short set.
## More: python -m aiordma bench --help (e.g. BENCH_ARGS="--sizes 8-16M --plot bench.png").
BENCH_ARGS ?= --tests send_lat,write_lat,read_lat,send_bw,write_bw,msg_rate,reactor \
	--sizes 64,4K,1M --iters 1000 --max-seconds 2 --baselines tcp-proto,unix-proto,memcpy
bench: setup
	AIORDMA_PROVIDER=soft $(PY) -m aiordma bench $(BENCH_ARGS)

## What a 64 B round trip costs the client: user-space instructions (callgrind) and
## Python calls, aiordma on soft against uvloop TCP (installs valgrind where missing).
bench-cost: setup
	@command -v valgrind >/dev/null 2>&1 || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq valgrind; }
	AIORDMA_PROVIDER=soft $(PY) -m aiordma bench --tests cost --baselines none

## The current results of README.md and docs/benchmarks.md: run the bench, keep its
## document and plot under docs/results/, and rewrite both tables from the document.
RESULTS_ARGS ?= --provider soft --tests send_lat,write_lat,read_lat,atomic_lat,send_bw,write_bw,msg_rate \
	--sizes 64,4K,1M --iters 1000 --max-seconds 2 --rounds 3 --baselines tcp-proto,unix-proto,memcpy
results: setup
	$(PY) -m pip install -q -e '.[test,plot]'
	$(PY) -m aiordma bench $(RESULTS_ARGS) --save docs/results/current.json --plot docs/results/current.png
	$(PY) -m aiordma.bench.report docs/results/current.json --update README.md docs/benchmarks.md

## The UCXX baselines (RAPIDS' UCX bindings over shared memory, polling and blocking
## progress) beside aiordma and asyncio TCP. ucxx-cu12 and its libraries (about 85 MB)
## go into a venv of their own, never into $(VENV).
UCXX_VENV ?= build/ucxx-venv
BENCH_UCXX_ARGS ?= --provider soft --tests send_lat,msg_rate --sizes 64,4K,1M --iters 1000 \
	--max-seconds 2 --baselines tcp-proto,ucxx-poll,ucxx-block
$(UCXX_VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(UCXX_VENV)
	$(UCXX_VENV)/bin/python -m pip install -q --upgrade pip 'setuptools>=77'
	$(UCXX_VENV)/bin/python -m pip install -q -e '.[ucxx,uvloop]'
	touch $@
bench-ucxx: $(UCXX_VENV)/.stamp
	$(UCXX_VENV)/bin/python -m aiordma bench $(BENCH_UCXX_ARGS)

## soft between two network namespaces against plain TCP on the same link, measured in
## the same run: clean, 10% loss, reordering, delay; a receiver paused 3 s (root; about 4
## minutes). BENCH_NET_ARGS="--sweep 15,16,17,18,19": the retry-policy sweep of docs/networks.md.
BENCH_NET_ARGS ?=
bench-net: setup net-prereqs
	$(PY) -m aiordma.bench.network $(BENCH_NET_ARGS)

## The same harness on real verbs in the Soft-RoCE VM: aiordma's `verbs` provider against
## a synchronous busy-polling pyverbs program and perftest (ib_send_lat, ib_write_bw)
## over rxe0, 3 interleaved rounds, in one VM run (about 5 minutes; AIORDMA_RXE_TIMEOUT
## bounds it). Keep the
## output: AIORDMA_RXE_RESULTS=DIR make bench-rxe (DIR/output.log).
BENCH_RXE_ARGS ?= --provider verbs --tests send_lat,write_bw --sizes-for send_lat=64,4K \
	--sizes-for write_bw=64K,1M --iters 300 --max-seconds 2 --rounds 3 --baselines pyverbs,pyverbs-async,perftest
BENCH_RXE_TIMEOUT ?= 420
bench-rxe:
	AIORDMA_RXE_TIMEOUT=$${AIORDMA_RXE_TIMEOUT:-$(BENCH_RXE_TIMEOUT)} \
		bash tests/rxe/run-vm.sh -- python3 -m aiordma bench $(BENCH_RXE_ARGS)
