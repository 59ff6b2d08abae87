#!/bin/bash
# Runs inside the Soft-RoCE guest as PID 1 (exec'd by /sbin/aiordma-rxe-init from the
# read-only "rxectl" 9p share that run-vm.sh prepares for each run). It
#   1. mounts the basics, the results share and the project (read-only 9p + tmpfs overlay),
#   2. brings up the NIC with a static address, creates rxe0 and REQUIRES it to be ACTIVE
#      with an IPv4 RoCE v2 GID (otherwise the run fails: the tier is never silently skipped),
#   3. runs the requested command in /project, tee'ing its output to the console and to
#      results/output.log (the kernel's messages go to results/kernel.log instead), and
#      prints "AIORDMA-RXE-EXIT=<rc>",
#   4. powers the VM off.
set -u
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8 TERM=dumb
CTL=/run/rxectl
RESULTS=/run/rxe-results
PROJECT=/project

poweroff_now() {
    sync
    echo 1 > /proc/sys/kernel/printk      # no I/O-error noise from the abrupt power-off
    mkfifo /run/.aiordma-halt 2>/dev/null
    echo o > /proc/sysrq-trigger
    # Wait with a builtin: once the disk is gone no program can be executed any more.
    read -r -t 60 _ <> /run/.aiordma-halt
}

# sleep(1) costs a fork+exec, which is slow under TCG: nap with a builtin instead.
mkfifo /run/.aiordma-nap 2>/dev/null
nap() { read -r -t "$1" _ <> /run/.aiordma-nap || true; }

# wait_for SECONDS COMMAND...: poll every 0.05 s until COMMAND succeeds; false on timeout.
wait_for() {
    local deadline=$((SECONDS + $1)); shift
    until "$@"; do
        [ "$SECONDS" -lt "$deadline" ] || return 1
        nap 0.05
    done
}

fail() {
    echo
    echo "AIORDMA-RXE-SETUP-FAILED: $*"
    if [ -w "$RESULTS" ]; then echo "$*" > "$RESULTS/setup-failed"; fi
    echo "--- diagnostics ---"
    ip -br link 2>&1; ip -br addr 2>&1; rdma link show 2>&1
    dmesg 2>/dev/null | tail -n 40
    poweroff_now
}

# shellcheck source=/dev/null
. "$CTL/settings.sh" || fail "cannot read $CTL/settings.sh"
: "${RXE_ADDR:=10.0.2.15/24}" "${RXE_GATEWAY=10.0.2.2}" "${RXE_DEV:=rxe0}"
: "${RXE_MTU:=}" "${RXE_PEER:=}" "${RXE_NAME:=aiordma-rxe}"

# --- basic mounts --------------------------------------------------------------------
mountpoint -q /tmp || mount -t tmpfs -o mode=1777 tmpfs /tmp || fail "mount /tmp"
mkdir -p /dev/pts /dev/shm
mountpoint -q /dev/pts || mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
mountpoint -q /dev/shm || mount -t tmpfs -o mode=1777 tmpfs /dev/shm
hostname "$RXE_NAME" 2>/dev/null || echo "$RXE_NAME" > /proc/sys/kernel/hostname
modprobe virtio_rng 2>/dev/null || true

mkdir -p "$RESULTS"
mount -t 9p -o trans=virtio,version=9p2000.L results "$RESULTS" || fail "mount 9p results"

# The project: read-only 9p, made writable (in RAM) by an overlay so that tests may write
# next to their files without touching the host tree. Falls back to the read-only view.
mkdir -p /run/project-ro /run/project-rw "$PROJECT"
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 project /run/project-ro 2>/dev/null \
    || mount -t 9p -o trans=virtio,version=9p2000.L,ro project /run/project-ro \
    || fail "mount 9p project"
mount -t tmpfs -o mode=0755 tmpfs /run/project-rw
mkdir -p /run/project-rw/upper /run/project-rw/work
if ! mount -t overlay overlay \
        -o lowerdir=/run/project-ro,upperdir=/run/project-rw/upper,workdir=/run/project-rw/work \
        "$PROJECT" 2>/dev/null; then
    echo "aiordma-rxe: overlayfs over 9p unavailable; the project is mounted read-only"
    mount --bind /run/project-ro "$PROJECT" || fail "bind-mount project"
fi
# A native build on the host (make native) is for the host's Python, so its extension
# modules go (from the overlay only: the host tree is untouched); the guest builds its
# own below.
if [ -n "$(find "$PROJECT/aiordma" -name '*.so' -print -quit)" ]; then
    find "$PROJECT/aiordma" -name '*.so' -delete 2>/dev/null \
        || fail "the host's native build (aiordma/**/*.so) is in the read-only project: make clean-native"
fi

# --- network -------------------------------------------------------------------------
modprobe virtio_net || fail "modprobe virtio_net"
ip link set lo up
find_nic() {
    local d
    for d in /sys/class/net/*; do
        [ "${d##*/}" != lo ] && [ -e "$d/device" ] && { nic=${d##*/}; return 0; }
    done
    return 1
}
nic=""
wait_for 10 find_nic || fail "no network interface appeared after modprobe virtio_net"
# RXE_MTU: the NIC's MTU (rxe's active_mtu follows it: the largest IB MTU that fits in
# it with the RoCE v2 headers: 1500 gives 1024, 2500 gives 2048, 9000 gives 4096).
if [ -n "$RXE_MTU" ]; then
    ip link set "$nic" mtu "$RXE_MTU" || fail "ip link set $nic mtu $RXE_MTU"
fi
ip link set "$nic" up || fail "ip link set $nic up"
ip addr add "$RXE_ADDR" dev "$nic" || fail "ip addr add $RXE_ADDR dev $nic"
# RXE_GATEWAY empty: no default route (two guests on a private link reach only it)
if [ -n "$RXE_GATEWAY" ]; then
    ip route add default via "$RXE_GATEWAY" dev "$nic" 2>/dev/null || true
fi
link_up() { local o; read -r o < "/sys/class/net/$nic/operstate" && [ "$o" = up ]; }
wait_for 10 link_up || echo "aiordma-rxe: warning: $nic operstate is $(< "/sys/class/net/$nic/operstate")"

# --- Soft-RoCE -----------------------------------------------------------------------
modprobe ib_uverbs || fail "modprobe ib_uverbs"
modprobe rdma_rxe || fail "modprobe rdma_rxe"
rdma link add "$RXE_DEV" type rxe netdev "$nic" || fail "rdma link add $RXE_DEV type rxe netdev $nic"
state=""
port_active() {
    read -r state < "/sys/class/infiniband/$RXE_DEV/ports/1/state" 2>/dev/null || state=""
    [[ "$state" == *ACTIVE* ]]
}
wait_for 15 port_active || true
case "$state" in *ACTIVE*) ;; *) fail "$RXE_DEV port 1 is not ACTIVE (state: '${state:-missing}')" ;; esac
ls /dev/infiniband/uverbs* >/dev/null 2>&1 || fail "no /dev/infiniband/uverbs* device node"

# The IPv4-mapped RoCE v2 GID of the NIC address (index 1 on a fresh rxe device).
ip4=${RXE_ADDR%/*}
want=$(printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' ${ip4//./ })
gid_index=""
find_gid() {
    local g v
    for g in "/sys/class/infiniband/$RXE_DEV/ports/1/gids/"*; do
        read -r v < "$g" 2>/dev/null || continue
        if [ "$v" = "$want" ]; then gid_index=${g##*/}; return 0; fi
    done
    return 1
}
wait_for 10 find_gid || true
[ -n "$gid_index" ] || fail "$RXE_DEV has no IPv4 GID for $ip4"

ulimit -l unlimited || fail "ulimit -l unlimited"
ulimit -n 65536 2>/dev/null || true

# --- environment for the command -----------------------------------------------------
export AIORDMA_PROVIDER=verbs
# shellcheck source=/dev/null
. "$CTL/env.sh" || fail "cannot read $CTL/env.sh"      # AIORDMA_* etc. forwarded from the host
export PYTHONPATH="$PROJECT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# the guest is emulated (TCG, ~50x slower): an event loop can stall for seconds, longer
# than the heartbeat's default allows
export AIORDMA_LIVENESS_TIMEOUT="${AIORDMA_LIVENESS_TIMEOUT:-60}"
export AIORDMA_RXE_GUEST=1 AIORDMA_RXE_RESULTS="$RESULTS" AIORDMA_RXE_DEVICE="$RXE_DEV" \
       AIORDMA_RXE_NETDEV="$nic" AIORDMA_RXE_ADDR="$ip4" AIORDMA_RXE_GID_INDEX="$gid_index" \
       AIORDMA_RXE_MTU="$(< "/sys/class/net/$nic/mtu")" AIORDMA_RXE_NAME="$RXE_NAME"
# the other guest's address, when run-two-vms.sh joined two guests by a link
if [ -n "$RXE_PEER" ]; then export AIORDMA_RXE_PEER="$RXE_PEER"; fi
# Tests and examples connect over the address that carries the rxe GID (127.0.0.1 has none).
export AIORDMA_TEST_IP="${AIORDMA_TEST_IP:-$ip4}"
read -r up _ < /proc/uptime
echo "$up" > "$RESULTS/boot-seconds"

# The Cython extensions, built for the guest's Python against its rdma-core headers, and
# the mypyc modules the host built for it when it offered them (guest-build.sh); the
# command requires what was installed (AIORDMA_EXPECT_BUILD, checked by
# tests/test_native.py). AIORDMA_GUEST_BUILD=0 from the host runs the pure sources instead.
if [ "${AIORDMA_GUEST_BUILD:-1}" != 0 ]; then
    bash "$PROJECT/tests/rxe/guest-build.sh" "$RESULTS" \
        || fail "building aiordma's compiled modules in the guest failed (results/build.log)"
    if [ -s "$CTL/mypyc.tar" ]; then export AIORDMA_EXPECT_BUILD=mypyc,verbs
    else export AIORDMA_EXPECT_BUILD=verbs; fi
fi

# From here on the kernel's messages (rxe's "make_send_cqe: non-flush error status" of
# the error tests, say) stay out of the console, which carries the command's output:
# they go to results/kernel.log at the end. Oopses and panics still reach the console
# (the kernel raises the console level for them).
echo 1 > /proc/sys/kernel/printk
echo "aiordma-rxe: ${RXE_SUITE:-?} guest $RXE_NAME, kernel $(uname -r), $(python3 -V 2>&1)," \
     "$RXE_DEV $state on $nic $ip4 mtu $AIORDMA_RXE_MTU (gid index $gid_index), booted in ${up}s"
cmdline=$(tail -n 1 "$CTL/cmd.sh"); cmdline=${cmdline#exec }
[ ${#cmdline} -le 200 ] || cmdline="${cmdline:0:200}..."
echo "aiordma-rxe: running in $PROJECT: $cmdline"
echo "AIORDMA-RXE-START"

# A guest-side deadline shortly before the host's: SIGABRT makes Python's faulthandler
# (on by default under pytest) print every thread's traceback, so a hang shows where it hangs.
read -r now _ < /proc/uptime   # (the build's time included)
budget=$(( ${RXE_TIMEOUT:-1500} - ${now%.*} - 30 ))
[ "$budget" -ge 30 ] || budget=30
ulimit -c 0
cd "$PROJECT" || fail "cd $PROJECT"
# No pipe to tee: a process the command leaves behind (a test's stray server) would keep
# the pipe open and the VM would never power off. Stream the log file instead, until the
# command itself exits; leftovers die with the VM.
# The log is written to the guest's tmpfs and copied to the results share at the end:
# following a file on 9p with tail -f fails ("No data available") under load.
LOG=/tmp/aiordma-output.log
: > "$LOG"
timeout -s ABRT -k 20 "$budget" bash "$CTL/cmd.sh" < /dev/null > "$LOG" 2>&1 &
cmd_pid=$!
tail -n +1 --pid="$cmd_pid" -f "$LOG"
wait "$cmd_pid"
rc=$?
cp "$LOG" "$RESULTS/output.log" 2>/dev/null || true
if [ "$rc" = 124 ]; then
    echo "aiordma-rxe: the command timed out after ${budget}s in the guest (AIORDMA_RXE_TIMEOUT); it got SIGABRT"
    echo "$budget" > "$RESULTS/timed-out"
fi

dmesg > "$RESULTS/kernel.log" 2>&1 || true
read -r end _ < /proc/uptime
echo "$end" > "$RESULTS/end-seconds"
echo "$rc" > "$RESULTS/exit-code"
sync
echo
echo "AIORDMA-RXE-EXIT=$rc"
umount "$RESULTS" 2>/dev/null
poweroff_now
