#!/usr/bin/env bash
# Two Soft-RoCE guests joined by one Ethernet link: the `verbs` provider between hosts.
#
#   tests/rxe/run-two-vms.sh [-- command ...]
#
# Boots two guests of run-vm.sh's cached image, each with rxe0 on its NIC, the NICs joined
# by a point-to-point link (qemu's socket netdev over UDP on 127.0.0.1; no other network):
#   a  10.77.0.1/24, MTU $AIORDMA_RXE_MTU_A (9000): runs tests/rxe/two_host_peer.py, the
#      control server the tests drive (it starts, inspects and kills aiordma servers);
#   b  10.77.0.2/24, MTU $AIORDMA_RXE_MTU_B (2500): runs the command (default: pytest on
#      tests/test_rxe_two_hosts.py), with AIORDMA_RXE_PEER=10.77.0.1 (a's control port
#      is 7470, CONTROL_PORT there).
# Exits with b's status, else a's when a failed. b ending, a ending before b, a signal or
# the overall timeout (AIORDMA_RXE_TIMEOUT plus a margin) stops both guests.
# Results: AIORDMA_RXE_RESULTS (else a temporary directory) gets a/ and b/ (each as
# run-vm.sh's results: output.log, kernel.log, exit-code ...) and a.log, b.log (each
# guest's console as run-vm.sh printed it).
set -Eeuo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE_ROOT=${AIORDMA_RXE_CACHE:-$HOME/.cache/aiordma-rxe}
TIMEOUT=${AIORDMA_RXE_TIMEOUT:-1200}
# Each guest: one vCPU (two guests on a 2-core host; set AIORDMA_RXE_SMP for more), 1.5 GiB.
export AIORDMA_RXE_SMP=${AIORDMA_RXE_SMP:-1} AIORDMA_RXE_MEM=${AIORDMA_RXE_MEM:-1536}
MTU_A=${AIORDMA_RXE_MTU_A:-9000}
MTU_B=${AIORDMA_RXE_MTU_B:-2500}
ADDR_A=10.77.0.1
ADDR_B=10.77.0.2
CONTROL_PORT=7470   # tests/test_rxe_two_hosts.py's CONTROL_PORT
# how long a may take to end after b ended (b's tests tell its peer to quit)
A_GRACE=${AIORDMA_RXE_A_GRACE:-90}

log() { printf 'aiordma-rxe-two: %s\n' "$*" >&2; }

if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0
fi
[ "${1:-}" = -- ] && shift
if [ $# -gt 0 ]; then CMD=("$@")
# (the async tests on uvloop only: which loop drives an endpoint is not what crosses hosts)
else CMD=(python3 -m pytest -p no:cacheprovider -q -rfEs --durations=10
          -k "uvloop or not asyncio" tests/test_rxe_two_hosts.py)
fi
[[ "$TIMEOUT" =~ ^[0-9]+$ ]] || { log "AIORDMA_RXE_TIMEOUT must be a number of seconds"; exit 64; }

OUT=${AIORDMA_RXE_RESULTS:-}
TMP_OUT=""
if [ -z "$OUT" ]; then OUT=$(mktemp -d "${TMPDIR:-/tmp}/aiordma-rxe-two.XXXXXX"); TMP_OUT=$OUT; fi
mkdir -p "$OUT/a" "$OUT/b"
OUT=$(cd "$OUT" && pwd -P)

PID_A="" PID_B="" TAIL_PIDS=()

# stop_guest PID: end one run-vm.sh (its own process group: setsid below) and its qemu;
# SIGTERM first (run-vm.sh's trap stops qemu and cleans up), SIGKILL after 30 s.
stop_guest() {
    local pid=$1 i
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 150); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.2
    done
    kill -KILL -- "-$pid" 2>/dev/null || true
}

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    stop_guest "$PID_B"
    stop_guest "$PID_A"
    local t
    for t in "${TAIL_PIDS[@]}"; do kill "$t" 2>/dev/null || true; done
    if [ -n "$TMP_OUT" ] && [ "${AIORDMA_RXE_KEEP:-0}" != 1 ]; then rm -rf "$TMP_OUT"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# free_udp_port: a UDP port of 127.0.0.1 that nothing is bound to now.
free_udp_port() {
    python3 -c 'import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# start_guest NAME ADDR MTU LOCAL_PORT REMOTE_PORT MAC PEER CMD...: one run-vm.sh in the
# background, in a process group of its own, its console in $OUT/NAME.log (streamed with
# a "[NAME] " prefix); sets START_PID.
start_guest() {
    local name=$1 addr=$2 mtu=$3 lport=$4 rport=$5 mac=$6 peer=$7
    shift 7
    : > "$OUT/$name.log"
    AIORDMA_RXE_PARALLEL=1 AIORDMA_RXE_QUIET=0 AIORDMA_RXE_RESULTS="$OUT/$name" \
        AIORDMA_RXE_NAME="rxe-$name" AIORDMA_RXE_ADDR="$addr/24" AIORDMA_RXE_GATEWAY= \
        AIORDMA_RXE_MTU="$mtu" AIORDMA_RXE_MAC="$mac" AIORDMA_RXE_PEER="$peer" \
        AIORDMA_RXE_LINK="socket,udp=127.0.0.1:$rport,localaddr=127.0.0.1:$lport" \
        AIORDMA_RXE_TIMEOUT="$TIMEOUT" \
        setsid bash "$HERE/run-vm.sh" -- "$@" </dev/null >"$OUT/$name.log" 2>&1 &
    START_PID=$!
    tail -n +1 -f --pid="$START_PID" "$OUT/$name.log" | sed -u "s/^/[$name] /" &
    TAIL_PIDS+=($!)
}

# exit status of a finished background job (wait once; later calls get the saved value)
declare -A RC=()
reap() { local rc=0; wait "$1" || rc=$?; RC[$1]=$rc; }

bash "$HERE/run-vm.sh" --build-only >/dev/null   # build (or find) the image once, for both

# One pair of guests at a time per cache, as run-vm.sh does for one guest.
if [ "${AIORDMA_RXE_PARALLEL:-0}" != 1 ]; then
    lockf="$CACHE_ROOT/.run.lock"
    [ -w "$CACHE_ROOT" ] || lockf="${TMPDIR:-/tmp}/aiordma-rxe-run.lock"
    exec 8>>"$lockf"
    if ! flock -n 8; then
        log "another aiordma-rxe VM is running; waiting for it (AIORDMA_RXE_PARALLEL=1 skips this)"
        flock 8
    fi
fi

PORT_A=$(free_udp_port)
PORT_B=$(free_udp_port)
while [ "$PORT_B" = "$PORT_A" ]; do PORT_B=$(free_udp_port); done
log "link: a 127.0.0.1:$PORT_A <-> b 127.0.0.1:$PORT_B (UDP); a $ADDR_A mtu $MTU_A, b $ADDR_B mtu $MTU_B"
START_PID=""
start_guest a "$ADDR_A" "$MTU_A" "$PORT_A" "$PORT_B" 52:54:00:77:00:01 "$ADDR_B" \
    python3 tests/rxe/two_host_peer.py --host "$ADDR_A" --port "$CONTROL_PORT" \
    --lifetime "$((TIMEOUT - 60))"
PID_A=$START_PID
start_guest b "$ADDR_B" "$MTU_B" "$PORT_B" "$PORT_A" 52:54:00:77:00:02 "$ADDR_A" "${CMD[@]}"
PID_B=$START_PID

# Wait for b (bounded: each guest's run-vm.sh enforces TIMEOUT on its qemu; this adds a
# margin for boot retries and teardown). a failing first stops b at once; a ending well
# (b's tests told it to quit, b is finishing) gives b B_GRACE seconds more.
B_GRACE=${AIORDMA_RXE_B_GRACE:-120}
deadline=$((SECONDS + TIMEOUT + 120))
while kill -0 "$PID_B" 2>/dev/null; do
    if [ -z "${RC[$PID_A]:-}" ] && ! kill -0 "$PID_A" 2>/dev/null; then
        reap "$PID_A"
        if [ "${RC[$PID_A]}" != 0 ]; then
            log "guest a (the peer) failed first (exit ${RC[$PID_A]}): stopping guest b"
            stop_guest "$PID_B"
            break
        fi
        deadline=$((SECONDS < deadline - B_GRACE ? SECONDS + B_GRACE : deadline))
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        log "guest b did not end in time (AIORDMA_RXE_TIMEOUT + 120 s, or $B_GRACE s after a ended): stopping both guests"
        exit 124
    fi
    sleep 1
done
reap "$PID_B"
rc_b=${RC[$PID_B]}
if [ -z "${RC[$PID_A]:-}" ]; then
    a_deadline=$((SECONDS + A_GRACE))
    while kill -0 "$PID_A" 2>/dev/null && [ "$SECONDS" -lt "$a_deadline" ]; do sleep 1; done
    if kill -0 "$PID_A" 2>/dev/null; then
        log "guest a still running ${A_GRACE} s after b ended: stopping it"
        stop_guest "$PID_A"
    fi
    reap "$PID_A"
fi
rc_a=${RC[$PID_A]}
sleep 1   # let the console tails print their last lines
log "guest a (peer) exited $rc_a, guest b (command) exited $rc_b; results in $OUT"
if [ "$rc_b" != 0 ]; then exit "$rc_b"; fi
exit "$rc_a"
