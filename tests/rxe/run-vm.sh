#!/usr/bin/env bash
# Run a command against real verbs (Soft-RoCE, rdma_rxe) inside a throw-away Debian VM.
#
#   tests/rxe/run-vm.sh [options] [-- command ...]
#
# The guest image is built once (debootstrap + mke2fs) and cached outside the repository;
# each run boots it under qemu (TCG) on a fresh copy-on-write overlay, with the project
# tree visible read-only (9p, writable in RAM through an overlay) in the guest's /project.
# See tests/rxe/README.md for the environment variables, exit codes and measured timings.
set -Eeuo pipefail

# ---- exit codes ---------------------------------------------------------------------
# Anything else is the guest command's own exit status.
readonly EX_USAGE=64          # bad arguments
readonly EX_UNAVAILABLE=69    # guest setup failed (e.g. rxe0 not ACTIVE) / host tools missing
readonly EX_SOFTWARE=70       # image build failed for a reason inside the project/host
readonly EX_TEMPFAIL=75       # image build failed for an outside reason (mirror unreachable): retry later
readonly EX_TIMEOUT=124       # AIORDMA_RXE_TIMEOUT expired before the command finished
readonly EX_NOMARKER=125      # qemu ended without the guest's exit marker (crash, panic, ...)

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(git -C "$HERE" rev-parse --show-toplevel 2>/dev/null || (cd "$HERE/../.." && pwd))

SUITE=${AIORDMA_RXE_SUITE:-forky}
CACHE_ROOT=${AIORDMA_RXE_CACHE:-$HOME/.cache/aiordma-rxe}
TIMEOUT=${AIORDMA_RXE_TIMEOUT:-1500}
MIRROR=${AIORDMA_RXE_MIRROR:-}   # else the host's apt sources (choose_mirror)
MEM=${AIORDMA_RXE_MEM:-2048}
SMP=${AIORDMA_RXE_SMP:-2}
ACCEL=${AIORDMA_RXE_ACCEL:-tcg,thread=multi}
BOOT_TRIES=${AIORDMA_RXE_BOOT_TRIES:-3}
# The guest's NIC (see net_args): user networking with qemu's 10.0.2.0/24 by default;
# AIORDMA_RXE_LINK names a qemu netdev instead (run-two-vms.sh joins two guests by one).
GUEST_ADDR=${AIORDMA_RXE_ADDR:-10.0.2.15/24}
GATEWAY=${AIORDMA_RXE_GATEWAY-10.0.2.2}  # empty: no default route
LINK=${AIORDMA_RXE_LINK:-user}
MAC=${AIORDMA_RXE_MAC:-52:54:00:12:34:56}
NIC_MTU=${AIORDMA_RXE_MTU:-}
PEER=${AIORDMA_RXE_PEER:-}
NAME=${AIORDMA_RXE_NAME:-aiordma-rxe}

log() { printf 'aiordma-rxe: %s\n' "$*" >&2; }
die() { local code=$1; shift; printf 'aiordma-rxe: %s\n' "$*" >&2; exit "$code"; }

usage() {
    cat <<EOF
usage: tests/rxe/run-vm.sh [options] [-- command ...]

Boots a Debian ($SUITE) VM with Soft-RoCE (rxe0 ACTIVE), runs the command in the
project directory and exits with its status. Default command:
    python3 -m pytest -p no:cacheprovider -q -rfEs tests

options:
  --build-only   build (or reuse) the cached image and exit
  --rebuild      rebuild the image even if a cached one exists
  --print-key    print the image cache key (e.g. for a CI cache) and exit
  --print-image  print the cached image directory (building it if needed) and exit
  --print-mirrors  print the Debian mirrors an image build would try, in order, and exit
  -h, --help     this text

environment: AIORDMA_RXE_SUITE (forky|bookworm), AIORDMA_RXE_CACHE, AIORDMA_RXE_TIMEOUT,
AIORDMA_RXE_MIRROR, AIORDMA_RXE_RESULTS, AIORDMA_RXE_QUIET, AIORDMA_RXE_KEEP,
AIORDMA_RXE_MEM, AIORDMA_RXE_SMP, AIORDMA_RXE_ACCEL, AIORDMA_RXE_EXTRA_PACKAGES,
AIORDMA_RXE_PARALLEL, AIORDMA_RXE_BOOT_TRIES, AIORDMA_RXE_ADDR, AIORDMA_RXE_GATEWAY,
AIORDMA_RXE_LINK, AIORDMA_RXE_MAC, AIORDMA_RXE_MTU, AIORDMA_RXE_PEER, AIORDMA_RXE_NAME,
AIORDMA_RXE_NATIVE_CACHE (see tests/rxe/README.md)
EOF
}

# ---- arguments ----------------------------------------------------------------------
ACTION=run
REBUILD=${AIORDMA_RXE_REBUILD:-0}
while [ $# -gt 0 ]; do
    case "$1" in
        --) shift; break ;;
        --build-only) ACTION=build; shift ;;
        --rebuild) REBUILD=1; shift ;;
        --print-key) ACTION=key; shift ;;
        --print-image) ACTION=image; shift ;;
        --print-mirrors) ACTION=mirrors; shift ;;
        -h|--help) usage; exit 0 ;;
        -*) usage >&2; die $EX_USAGE "unknown option: $1" ;;
        *) break ;;
    esac
done
if [ $# -gt 0 ]; then
    CMD=("$@")
else
    CMD=(python3 -m pytest -p no:cacheprovider -q -rfEs tests)
fi
case "$SUITE" in
    forky|bookworm|trixie|sid|testing|unstable) ;;
    *) die $EX_USAGE "AIORDMA_RXE_SUITE must be forky or bookworm (got '$SUITE')" ;;
esac
[[ "$TIMEOUT" =~ ^[0-9]+$ ]] || die $EX_USAGE "AIORDMA_RXE_TIMEOUT must be a number of seconds"
[[ "$BOOT_TRIES" =~ ^[1-9][0-9]*$ ]] || die $EX_USAGE "AIORDMA_RXE_BOOT_TRIES must be a number >= 1"
[[ "$GUEST_ADDR" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+/[0-9]+$ ]] || die $EX_USAGE "AIORDMA_RXE_ADDR must be an IPv4 address/prefix (got '$GUEST_ADDR')"
[[ "$MAC" =~ ^([0-9a-f]{2}:){5}[0-9a-f]{2}$ ]] || die $EX_USAGE "AIORDMA_RXE_MAC must be a lower-case MAC address (got '$MAC')"
[[ -z "$NIC_MTU" || "$NIC_MTU" =~ ^[0-9]+$ ]] || die $EX_USAGE "AIORDMA_RXE_MTU must be a number of bytes"
[[ "$NAME" =~ ^[a-z0-9-]+$ ]] || die $EX_USAGE "AIORDMA_RXE_NAME must be a host name of a-z, 0-9 and '-'"

# ---- package list and cache key -----------------------------------------------------
PKGS=()
while read -r line; do
    line=${line%%#*}
    for p in $line; do PKGS+=("$p"); done
done < "$HERE/guest-packages.txt"
EXTRA=${AIORDMA_RXE_EXTRA_PACKAGES:-}
for p in ${EXTRA//,/ }; do PKGS+=("$p"); done
mapfile -t PKGS < <(printf '%s\n' "${PKGS[@]}" | sort -u)

# Everything that shapes the image goes into the key: suite, package list, the baked stub
# init and the code of the build functions (so changing how the image is made rebuilds it).
image_key() {
    {
        printf 'suite=%s\narch=amd64\n' "$SUITE"
        printf 'pkg=%s\n' "${PKGS[@]}"
        cat "$HERE/guest-stub-init"
        declare -f build_image install_packages configure_root make_image run_group
    } | sha256sum | cut -c1-16
}

# ---- Debian mirror --------------------------------------------------------------------
# The mirrors of the host's own apt sources, in order, one a line: the URIs of "deb"
# entries (one-line sources.list files and deb822 .sources files) that name a release
# suite (one without a '-': bookworm, not bookworm-security or bookworm-updates). apt's
# configuration says where the sources are (apt-config; APT_CONFIG is honoured).
host_mirrors() {
    local list=/etc/apt/sources.list parts=/etc/apt/sources.list.d f
    if command -v apt-config >/dev/null 2>&1; then
        eval "$(apt-config shell list Dir::Etc::sourcelist/f parts Dir::Etc::sourceparts/d)"
    fi
    {
        for f in "$list" "${parts%/}"/*.list; do
            [ -f "$f" ] || continue
            awk '$1 == "deb" { i = 2
                     if ($2 ~ /^\[/) { while (i < NF && $i !~ /\]$/) i++; i++ }
                     if ($(i + 1) !~ /-/) print $i }' "$f"
        done
        for f in "${parts%/}"/*.sources; do
            [ -f "$f" ] || continue
            awk 'BEGIN { RS = "" }
                 { types = uris = suites = ""; enabled = 1; key = ""
                   n = split($0, lines, "\n")
                   for (k = 1; k <= n; k++) {
                       line = lines[k]
                       if (line ~ /^#/) continue
                       if (match(line, /^[A-Za-z-]+:/)) {
                           key = tolower(substr(line, 1, RLENGTH - 1)); line = substr(line, RLENGTH + 1)
                       }
                       if (key == "types") types = types " " line
                       else if (key == "uris") uris = uris " " line
                       else if (key == "suites") suites = suites " " line
                       else if (key == "enabled" && line ~ /no/) enabled = 0
                   }
                   if (!enabled || types !~ /(^|[ \t])deb([ \t]|$)/) next
                   release = 0; ns = split(suites, s, /[ \t]+/)
                   for (j = 1; j <= ns; j++) if (s[j] != "" && s[j] !~ /-/) release = 1
                   if (!release) next
                   nu = split(uris, u, /[ \t]+/)
                   for (j = 1; j <= nu; j++) if (u[j] != "") print u[j] }' "$f"
        done
    } | sed 's#/*$##' | awk '!seen[$0]++'
}

# The mirrors a build tries: AIORDMA_RXE_MIRROR alone when set, else the host's.
mirror_candidates() {
    if [ -n "$MIRROR" ]; then echo "$MIRROR"; else host_mirrors; fi
}

# Sets MIRROR to the first candidate that has the guest suite (build_image checks it
# once more and reports its errors); with none that has it, the first candidate.
choose_mirror() {
    local -a cands
    local m
    mapfile -t cands < <(mirror_candidates)
    [ ${#cands[@]} -gt 0 ] || die $EX_UNAVAILABLE "no Debian mirror in the host's apt sources (deb entries of a release suite); set AIORDMA_RXE_MIRROR=URL"
    command -v wget >/dev/null 2>&1 || ensure_tools wget:wget
    for m in "${cands[@]}"; do
        if wget -q -T 30 -t 2 -O /dev/null "$m/dists/$SUITE/Release"; then MIRROR=$m; return 0; fi
    done
    MIRROR=${cands[0]}
    log "no mirror of ${cands[*]} has dists/$SUITE (or none answered); set AIORDMA_RXE_MIRROR=URL to choose one"
}

# ---- host tools ---------------------------------------------------------------------
as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"
    elif command -v sudo >/dev/null 2>&1; then sudo -n "$@"
    else return 1
    fi
}

# ensure_tools "cmd:package" ... — installs the packages of missing commands via apt-get.
ensure_tools() {
    local spec cmd pkg missing=()
    for spec in "$@"; do
        cmd=${spec%%:*}; pkg=${spec#*:}
        if [ "${cmd:0:1}" = / ]; then [ -e "$cmd" ] && continue
        else command -v "$cmd" >/dev/null 2>&1 && continue
            [ -x "/usr/sbin/$cmd" ] || [ -x "/sbin/$cmd" ] && continue
        fi
        missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
    command -v apt-get >/dev/null 2>&1 \
        || die $EX_UNAVAILABLE "missing host packages (${missing[*]}) and no apt-get to install them"
    log "installing host packages: ${missing[*]}"
    local out
    out=$(mktemp)
    if ! as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q >"$out" 2>&1; then
        tail -n 20 "$out" >&2; rm -f "$out"
        die $EX_TEMPFAIL "host package install failed: apt-get update failed (mirror unreachable?)"
    fi
    if ! as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            "${missing[@]}" >"$out" 2>&1; then
        tail -n 20 "$out" >&2
        if grep -qiE 'Failed to fetch|Temporary failure|Could not resolve|Unable to connect' "$out"; then
            rm -f "$out"; die $EX_TEMPFAIL "host package install failed: mirror unreachable"
        fi
        rm -f "$out"; die $EX_UNAVAILABLE "host package install failed: apt-get install ${missing[*]}"
    fi
    rm -f "$out"
}
export PATH="$PATH:/usr/sbin:/sbin"

# ---- cleanup ------------------------------------------------------------------------
BUILD_TMP=""
RUN_DIR=""
QEMU_PID=""
TAIL_PID=""

umount_below() {  # unmount anything mounted at or below $1 (deepest first)
    local dir=$1 m
    [ -d "$dir" ] || return 0
    dir=$(cd "$dir" && pwd -P)
    while read -r m; do
        umount -l "$m" 2>/dev/null || true
    done < <(awk -v d="$dir" '$2 == d || index($2, d "/") == 1 { print $2 }' /proc/self/mounts | sort -r)
}

remove_tree() {
    [ -n "$1" ] && [ -e "$1" ] || return 0
    umount_below "$1"
    rm -rf --one-file-system "$1"
}

# run_group LOG SHOW CMD...: run CMD in a process group of its own with its output appended
# to LOG (lines matching the regex SHOW, if any, are also shown), so that an interrupted run
# can stop all of it (see stop_group) before it removes the build directory.
GROUP_PID=""
run_group() {
    local logf=$1 show=$2 start tpid="" rc=0
    shift 2
    start=$(stat -c %s "$logf" 2>/dev/null || echo 0)
    setsid "$@" >>"$logf" 2>&1 </dev/null &
    GROUP_PID=$!
    if [ -n "$show" ]; then
        tail -c +$((start + 1)) -f --pid="$GROUP_PID" "$logf" | grep --line-buffered -E "$show" >&2 &
        tpid=$!
    fi
    wait "$GROUP_PID" || rc=$?
    GROUP_PID=""
    if [ -n "$tpid" ]; then wait "$tpid" 2>/dev/null || true; fi
    return $rc
}

stop_group() {
    local pg=$1 i
    kill -TERM -- "-$pg" 2>/dev/null || return 0
    for i in $(seq 1 50); do
        kill -0 -- "-$pg" 2>/dev/null || return 0
        sleep 0.2
    done
    kill -KILL -- "-$pg" 2>/dev/null || true
    sleep 0.5
}

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ -n "$GROUP_PID" ]; then stop_group "$GROUP_PID"; fi
    if [ -n "$QEMU_PID" ] && kill -0 "$QEMU_PID" 2>/dev/null; then
        kill -TERM "$QEMU_PID" 2>/dev/null || true
        wait "$QEMU_PID" 2>/dev/null || true
    fi
    if [ -n "$TAIL_PID" ]; then kill "$TAIL_PID" 2>/dev/null || true; fi
    if [ -n "$BUILD_TMP" ]; then remove_tree "$BUILD_TMP"; fi
    if [ -n "$RUN_DIR" ] && [ -d "$RUN_DIR" ]; then
        if [ "${AIORDMA_RXE_KEEP:-0}" = 1 ]; then log "kept run directory $RUN_DIR"
        else rm -rf "$RUN_DIR"; fi
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---- image build --------------------------------------------------------------------
NET_ERRORS='Temporary failure resolving|Could not connect|Failed getting release file|Couldn.t download|Temporary failure in name resolution|Could not resolve|Name or service not known|Connection refused|Connection timed out|Network is unreachable|No route to host|Unable to establish|Unable to connect|failed: Connection|Read error|Hash Sum mismatch|Size mismatch|Failed to fetch'

# Keep the logs of a failed build (the build directory itself is removed).
save_failed_log() {
    local suitedir=$1 tmp=$2
    { cat "$tmp/build.log"; echo "--- debootstrap.log ---"; cat "$tmp/root/debootstrap/debootstrap.log"; } \
        > "$suitedir/failed-build.log" 2>/dev/null || true
    log "log of the failed build: $suitedir/failed-build.log"
}

build_image() {
    local suitedir=$1 key=$2 dest=$3
    local tmp="$suitedir/.build-$key-$$" script=""
    BUILD_TMP=$tmp
    mkdir -p "$tmp"
    local blog="$tmp/build.log"
    local t0=$SECONDS

    ensure_tools debootstrap:debootstrap mke2fs:e2fsprogs wget:wget gpgv:gpgv \
        /usr/share/keyrings/debian-archive-keyring.gpg:debian-archive-keyring
    [ "$(id -u)" = 0 ] || die $EX_UNAVAILABLE "building the VM image needs root (debootstrap); run once as root or point AIORDMA_RXE_CACHE at a prebuilt cache"

    # Outside problems first, with a clear message and a retry-later exit code.
    local werr rc=0
    werr=$(wget -nv -T 30 -t 2 -O /dev/null "$MIRROR/dists/$SUITE/Release" 2>&1 | tail -n 1) || rc=$?
    case $rc in
        0) ;;
        8) die $EX_SOFTWARE "VM image build failed: suite '$SUITE' not found on $MIRROR ($MIRROR/dists/$SUITE/Release) $werr" ;;
        *) die $EX_TEMPFAIL "VM image build failed: mirror unreachable ($MIRROR/dists/$SUITE/Release, wget exit $rc) $werr" ;;
    esac

    # debootstrap on an older host has no script for a newer suite: use sid's.
    if [ ! -e "/usr/share/debootstrap/scripts/$SUITE" ]; then
        script=/usr/share/debootstrap/scripts/sid
    fi
    # Stage 1: a minimal root. Only initramfs-tools is included here: debootstrap's resolver
    # takes the first alternative of "dracut | initramfs-tools" for the kernel, and dracut's
    # initrd does not switch root with a custom init=.
    log "building the $SUITE guest image (several minutes; log: $blog)"
    local show='^(E: |W: |I: (Retrieving Release|Resolving|Checking|Installing core|Unpacking required|Configuring required|Unpacking the base|Configuring the base|Base system))'
    [ "${AIORDMA_RXE_VERBOSE:-0}" = 1 ] && show='.'
    rc=0
    run_group "$blog" "$show" debootstrap --variant=minbase --arch=amd64 --components=main \
        --include=initramfs-tools "$SUITE" "$tmp/root" "$MIRROR" $script || rc=$?
    if [ "$rc" != 0 ]; then
        save_failed_log "$suitedir" "$tmp"
        tail -n 25 "$blog" >&2
        if grep -qE "$NET_ERRORS" "$blog"; then
            die $EX_TEMPFAIL "VM image build failed: mirror unreachable or inconsistent during debootstrap ($MIRROR); retry later"
        fi
        die $EX_SOFTWARE "VM image build failed: debootstrap exited $rc (see the log above)"
    fi
    umount_below "$tmp/root"
    # Stage 2: everything else through apt (a real resolver), in a chroot.
    log "installing ${#PKGS[@]} guest packages with apt-get in the guest root"
    if ! install_packages "$tmp/root" "$blog"; then
        save_failed_log "$suitedir" "$tmp"
        tail -n 25 "$blog" >&2
        if grep -qE "$NET_ERRORS" "$blog"; then
            die $EX_TEMPFAIL "VM image build failed: mirror unreachable or inconsistent during apt-get ($MIRROR); retry later"
        fi
        die $EX_SOFTWARE "VM image build failed: apt-get install in the guest root (see the log above)"
    fi
    umount_below "$tmp/root"
    configure_root "$tmp" >>"$blog" 2>&1 || { save_failed_log "$suitedir" "$tmp"; tail -n 25 "$blog" >&2; die $EX_SOFTWARE "VM image build failed: configuring the guest root (see the log above)"; }
    log "making the ext4 image"
    make_image "$tmp" >>"$blog" 2>&1 || { save_failed_log "$suitedir" "$tmp"; tail -n 25 "$blog" >&2; die $EX_SOFTWARE "VM image build failed: mke2fs (see the log above)"; }
    echo "$((SECONDS - t0))" > "$tmp/build-seconds"
    # The rename is the commit point: an interrupted build never becomes a cached image.
    # (A rebuild replaces the old image only now, after the new one is complete.)
    if [ -e "$dest" ]; then mv -T "$dest" "$suitedir/.old-$key-$$"; fi
    mv -T "$tmp" "$dest"
    BUILD_TMP=""
    remove_tree "$suitedir/.old-$key-$$"
    log "image built in $((SECONDS - t0)) s: $dest"
}

install_packages() {
    # Called in an `if !` context, where `set -e` does not apply: every step checks itself.
    local root=$1 blog=$2 rc=0
    local -a in_root=(chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
                      LC_ALL=C.UTF-8 DEBIAN_FRONTEND=noninteractive)
    printf '#!/bin/sh\nexit 101\n' > "$root/usr/sbin/policy-rc.d" && chmod 0755 "$root/usr/sbin/policy-rc.d" || return 1
    mount -t proc proc "$root/proc" || return 1
    mkdir -p "$root/dev/pts"
    mount -t devpts -o newinstance,ptmxmode=0666 devpts "$root/dev/pts" 2>/dev/null || true
    # The mirror may be a frozen snapshot whose Release has passed its Valid-Until date.
    local show=""
    [ "${AIORDMA_RXE_VERBOSE:-0}" = 1 ] && show='.'
    if ! run_group "$blog" "$show" "${in_root[@]}" apt-get update -q -o Acquire::Check-Valid-Until=false; then
        rc=1
    elif ! run_group "$blog" "$show" "${in_root[@]}" apt-get install -y -q --no-install-recommends \
            -o Dpkg::Use-Pty=0 "${PKGS[@]}"; then
        rc=1
    fi
    run_group "$blog" "" "${in_root[@]}" apt-get clean || true
    umount_below "$root/dev/pts"
    umount_below "$root/proc"
    rm -f "$root/usr/sbin/policy-rc.d"
    return $rc
}

configure_root() {
    # Called in an `||` context, where `set -e` does not apply: every step checks itself.
    local tmp=$1 root=$1/root ver m
    install -m 0755 "$HERE/guest-stub-init" "$root/sbin/aiordma-rxe-init" || return 1
    mkdir -p "$root/project" || return 1
    echo aiordma-rxe > "$root/etc/hostname" || return 1
    printf '127.0.0.1 localhost\n127.0.1.1 aiordma-rxe\n::1 localhost ip6-localhost ip6-loopback\n' \
        > "$root/etc/hosts" || return 1
    : > "$root/etc/fstab" || return 1
    echo 'nameserver 10.0.2.3' > "$root/etc/resolv.conf" || return 1   # qemu user networking
    # Newest kernel, with an initrd made by initramfs-tools (dracut's does not honour init=).
    ver=$(cd "$root/boot" && ls vmlinuz-* | sed 's/^vmlinuz-//' | sort -V | tail -n 1)
    [ -n "$ver" ] || { echo "no kernel in $root/boot"; return 1; }
    [ -s "$root/boot/initrd.img-$ver" ] || { echo "no initrd for kernel $ver"; return 1; }
    [ -x "$root/usr/sbin/mkinitramfs" ] || { echo "initramfs-tools is not installed"; return 1; }
    for m in drivers/infiniband/sw/rxe/rdma_rxe drivers/infiniband/core/ib_uverbs \
             net/9p/9pnet_virtio fs/9p/9p drivers/net/virtio_net fs/overlayfs/overlay; do
        ls "$root/lib/modules/$ver/kernel/$m".ko* >/dev/null 2>&1 \
            || grep -q "/${m##*/}.ko" "$root/lib/modules/$ver/modules.builtin" \
            || { echo "kernel $ver lacks module $m"; return 1; }
    done
    cp "$root/boot/vmlinuz-$ver" "$tmp/vmlinuz" || return 1
    cp "$root/boot/initrd.img-$ver" "$tmp/initrd.img" || return 1
    echo "$ver" > "$tmp/kernel-version" || return 1
    chroot "$root" /usr/bin/python3 -c 'import pyverbs.device' \
        || { echo "pyverbs does not import in the guest root"; return 1; }
    dpkg-query --admindir="$root/var/lib/dpkg" -W -f '${Package} ${Version}\n' > "$tmp/packages.txt" || return 1
    rm -f "$root"/var/cache/apt/archives/*.deb
    rm -rf "$root"/var/lib/apt/lists/*
}

make_image() {
    local tmp=$1 used size
    used=$(du -sxm "$tmp/root" | cut -f1) || return 1
    size=$(( used * 13 / 10 + 1024 ))
    [ "$size" -ge 2048 ] || size=2048
    truncate -s "${size}M" "$tmp/root.img" || return 1
    run_group "$tmp/build.log" "" mke2fs -q -F -t ext4 -L aiordma-rxe -d "$tmp/root" "$tmp/root.img" || return 1
    remove_tree "$tmp/root"
}

# Keep the current image and at most two other recently used ones per suite.
gc_images() {
    local suitedir=$1 keep=$2 d n=0
    while read -r d; do
        [ "$d" = "$keep" ] && continue
        n=$((n + 1))
        [ $n -le 2 ] && continue
        log "removing old image $d"
        rm -rf "$d"
    done < <(ls -1dt "$suitedir"/image-* 2>/dev/null)
}

ensure_image() {
    local key suitedir
    key=$(image_key)
    suitedir="$CACHE_ROOT/$SUITE"
    IMG_DIR="$suitedir/image-$key"
    if [ "$REBUILD" != 1 ] && [ -s "$IMG_DIR/root.img" ] && [ -s "$IMG_DIR/vmlinuz" ]; then
        return 0
    fi
    mkdir -p "$suitedir"
    exec 9>"$suitedir/.build.lock"
    if ! flock -n 9; then
        log "another process is building the $SUITE image; waiting"
        flock 9
    fi
    if [ "$REBUILD" = 1 ] || ! { [ -s "$IMG_DIR/root.img" ] && [ -s "$IMG_DIR/vmlinuz" ]; }; then
        local d
        for d in "$suitedir"/.build-* "$suitedir"/.old-*; do   # leftovers of interrupted builds
            [ -e "$d" ] && remove_tree "$d"
        done
        choose_mirror
        log "Debian mirror: $MIRROR"
        build_image "$suitedir" "$key" "$IMG_DIR"
        rm -f "$suitedir/failed-build.log"
        gc_images "$suitedir" "$IMG_DIR"
    fi
    REBUILD=0
    exec 9>&-
}

# ---- run ----------------------------------------------------------------------------
# The serial console, minus carriage returns and the firmware's terminal escape sequences.
clean_console() {
    sed -u -e 's/\r$//' -e 's/\x1b\[[0-9;?]*[A-Za-z]//g' -e 's/\x1bc//g'
}

# net_args: prints qemu's NIC arguments, one a line: user networking (AIORDMA_RXE_LINK
# unset or "user"), else the netdev AIORDMA_RXE_LINK names (e.g.
# "socket,udp=127.0.0.1:P,localaddr=127.0.0.1:Q", a point-to-point Ethernet link over
# UDP), with the NIC's MAC address AIORDMA_RXE_MAC (two guests on one link need two).
net_args() {
    if [ "$LINK" = user ]; then printf '%s\n' -netdev user,id=n0
    else printf '%s\n' -netdev "$LINK,id=n0"; fi
    printf '%s\n' -device "virtio-net-pci,netdev=n0,addr=03,mac=$MAC,romfile="
}

# guest_settings: the settings.sh that guest-init.sh reads (shell assignments).
guest_settings() {
    printf 'RXE_SUITE=%q\nRXE_ADDR=%q\nRXE_TIMEOUT=%q\n' "$SUITE" "$GUEST_ADDR" "$TIMEOUT"
    printf 'RXE_GATEWAY=%q\nRXE_MTU=%q\nRXE_PEER=%q\nRXE_NAME=%q\n' \
        "$GATEWAY" "$NIC_MTU" "$PEER" "$NAME"
}

# ---- the guest's build, kept ---------------------------------------------------------
# guest-build.sh compiles aiordma's Cython extensions in every guest (a minute or more
# under TCG). What it built is kept per image and sources, in $CACHE_ROOT/SUITE/native-KEY
# (files.tar: the extensions and aiordma/_build.json), and a later run of the same
# sources in the same image installs that instead (guest-build.sh checks that it
# imports, and builds when it does not). AIORDMA_RXE_NATIVE_CACHE=0 always builds.
NATIVE_DIR=""

# native_key: what the guest's build depends on: the image (its Python, Cython and
# rdma-core headers) and the build's sources.
native_key() {
    {
        echo "$IMG_DIR"
        (cd "$REPO" && find aiordma \( -name '*.pyx' -o -name '*.pxd' \) -print0 | LC_ALL=C sort -z \
            | xargs -0 -r sha256sum && sha256sum setup.py aiordma/native.py tests/rxe/guest-build.sh)
    } | sha256sum | cut -c1-16
}

# native_cache_offer CTL: a kept build of these sources, as CTL/native.tar for the guest.
native_cache_offer() {
    [ "${AIORDMA_GUEST_BUILD:-1}" != 0 ] && [ "${AIORDMA_RXE_NATIVE_CACHE:-1}" != 0 ] || return 0
    NATIVE_DIR="$(dirname "$IMG_DIR")/native-$(native_key)"
    if [ -s "$NATIVE_DIR/files.tar" ]; then cp "$NATIVE_DIR/files.tar" "$1/native.tar"; fi
}

# native_cache_keep RESULTS: keep the build the guest left in RESULTS/native.tar (it
# leaves one only after building and checking it); at most three kept per suite.
native_cache_keep() {
    [ -n "$NATIVE_DIR" ] && [ -s "$1/native.tar" ] && [ ! -s "$NATIVE_DIR/files.tar" ] || return 0
    local tmp="$NATIVE_DIR.tmp.$$" d n=0
    if mkdir -p "$tmp" && cp "$1/native.tar" "$tmp/files.tar" && mv -T "$tmp" "$NATIVE_DIR" 2>/dev/null; then
        log "kept the guest's build of the extensions: $NATIVE_DIR"
    fi
    rm -rf "$tmp"
    while read -r d; do
        n=$((n + 1))
        [ $n -le 3 ] || rm -rf "$d"
    done < <(ls -1dt "$(dirname "$NATIVE_DIR")"/native-* 2>/dev/null)
}

# ---- the mypyc modules, built on the host for the guest ----------------------------------
# guest_mypyc.py builds aiordma.native.MODULES, and the Cython extensions that need no
# system headers, for the image's Python with the host's mypy, Cython and C compiler
# against the guest's Python headers (under TCG that would take longer than the tests),
# kept in $CACHE_ROOT/SUITE/mypyc per guest Python and sources;
# guest-build.sh installs it. AIORDMA_GUEST_MYPYC: auto (the default: when the host's
# Python has mypy), 1 (required: the run fails without it; make test-rxe), 0 (never: the
# guest runs the mypyc modules as sources). AIORDMA_RXE_HOST_PYTHON: the Python with mypy
# (default: the repository's .venv, else python3).
mypyc_offer() {
    local mode=${AIORDMA_GUEST_MYPYC:-auto} py=${AIORDMA_RXE_HOST_PYTHON:-}
    case "$mode" in auto|0|1) ;; *) die $EX_USAGE "AIORDMA_GUEST_MYPYC=$mode: use auto, 0 or 1" ;; esac
    [ "${AIORDMA_GUEST_BUILD:-1}" != 0 ] && [ "$mode" != 0 ] || return 0
    if [ -z "$py" ]; then
        py="$REPO/.venv/bin/python"
        [ -x "$py" ] || py=python3
    fi
    if ! "$py" -c 'import mypyc' 2>/dev/null; then
        [ "$mode" = 1 ] && die $EX_UNAVAILABLE "AIORDMA_GUEST_MYPYC=1: $py has no mypy (mypyc) to build the guest's mypyc modules with"
        log "no mypy (mypyc) for $py: the guest runs the mypyc modules as sources"
        return 0
    fi
    ensure_tools debugfs:e2fsprogs cc:gcc
    local t0=$SECONDS
    if "$py" "$HERE/guest_mypyc.py" "$IMG_DIR/root.img" "$(dirname "$IMG_DIR")/mypyc" "$1/mypyc.tar"; then
        log "the guest's mypyc modules are ready ($((SECONDS - t0)) s)"
        return 0
    fi
    rm -f "$1/mypyc.tar"
    [ "$mode" = 1 ] && die $EX_SOFTWARE "building the guest's mypyc modules on the host failed (above)"
    log "building the guest's mypyc modules failed (above): the guest runs them as sources"
}

run_vm() {
    ensure_tools qemu-system-x86_64:qemu-system-x86 qemu-img:qemu-utils timeout:coreutils flock:util-linux
    RUN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/aiordma-rxe.XXXXXX")
    local ctl="$RUN_DIR/ctl" results=${AIORDMA_RXE_RESULTS:-$RUN_DIR/results}
    mkdir -p "$ctl" "$results"
    results=$(cd "$results" && pwd -P)

    install -m 0755 "$HERE/guest-init.sh" "$ctl/guest-init.sh"
    guest_settings > "$ctl/settings.sh"
    {
        local name
        while read -r name; do
            case "$name" in
                AIORDMA_RXE_*) ;;
                AIORDMA_*|PYTEST_ADDOPTS|HYPOTHESIS_*) printf 'export %s=%q\n' "$name" "${!name}" ;;
            esac
        done < <(compgen -e)
    } > "$ctl/env.sh"
    { echo '# the command given to run-vm.sh'; printf 'exec'; printf ' %q' "${CMD[@]}"; echo; } > "$ctl/cmd.sh"
    native_cache_offer "$ctl"
    mypyc_offer "$ctl"

    touch "$IMG_DIR" 2>/dev/null || true     # "last used", for gc_images

    # One VM at a time per cache (the machines this runs on are small).
    if [ "${AIORDMA_RXE_PARALLEL:-0}" != 1 ]; then
        local lockf="$CACHE_ROOT/.run.lock"
        [ -w "$CACHE_ROOT" ] || lockf="${TMPDIR:-/tmp}/aiordma-rxe-run.lock"
        exec 8>>"$lockf"
        if ! flock -n 8; then
            log "another aiordma-rxe VM is running; waiting for it (AIORDMA_RXE_PARALLEL=1 skips this)"
            flock 8
        fi
    fi

    local console="$RUN_DIR/console.log" quiet=${AIORDMA_RXE_QUIET:-0}
    local append="root=/dev/vda rw console=ttyS0 init=/sbin/aiordma-rxe-init panic=-1 quiet mitigations=off"
    [ -n "${AIORDMA_RXE_APPEND:-}" ] && append="$append $AIORDMA_RXE_APPEND"
    local -a qemu=(qemu-system-x86_64
        -accel "$ACCEL" -cpu max -smp "$SMP" -m "$MEM"
        -nodefaults -display none -serial stdio -no-reboot
        -kernel "$IMG_DIR/vmlinuz" -initrd "$IMG_DIR/initrd.img" -append "$append"
        -drive "file=$RUN_DIR/overlay.qcow2,if=virtio,format=qcow2")
    local -a nic   # (before the devices without an address: the NIC takes PCI slot 3)
    mapfile -t nic < <(net_args)
    qemu+=("${nic[@]}"
        -device virtio-rng-pci
        -virtfs "local,path=$REPO,mount_tag=project,security_model=none,readonly=on"
        -virtfs "local,path=$ctl,mount_tag=rxectl,security_model=none,readonly=on"
        -virtfs "local,path=$results,mount_tag=results,security_model=none")
    # shellcheck disable=SC2206
    [ -n "${AIORDMA_RXE_QEMU_ARGS:-}" ] && qemu+=(${AIORDMA_RXE_QEMU_ARGS})

    local shown="${CMD[*]}"
    [ ${#shown} -le 200 ] || shown="${shown:0:200}..."
    local t0 qrc try=1 panic started
    while :; do
        log "booting $SUITE guest $NAME (timeout ${TIMEOUT}s): $shown"
        # a fresh overlay and results per boot: a guest that crashed leaves nothing behind
        rm -f "$RUN_DIR/overlay.qcow2" "$results/native.tar" \
            "$results"/{exit-code,output.log,kernel.log,setup-failed,boot-seconds,end-seconds,timed-out}
        qemu-img create -q -f qcow2 -F raw -b "$IMG_DIR/root.img" "$RUN_DIR/overlay.qcow2"
        t0=$SECONDS qrc=0
        : > "$console"
        timeout -k 15 "$TIMEOUT" "${qemu[@]}" </dev/null >"$console" 2>&1 &
        QEMU_PID=$!
        if [ "$quiet" != 1 ]; then
            tail -n +1 -f --pid="$QEMU_PID" "$console" | clean_console &
            TAIL_PID=$!
        fi
        wait "$QEMU_PID" || qrc=$?
        QEMU_PID=""
        if [ -n "$TAIL_PID" ]; then wait "$TAIL_PID" 2>/dev/null || true; TAIL_PID=""; fi
        # The guest kernel now and then dies while booting under TCG (seen: an int3 oops
        # in sched_clock_cpu during early init, forky's 7.2 kernel). When qemu ended on
        # its own before the guest started the command (no AIORDMA-RXE-START, no setup
        # failure), nothing of the command ran: boot again, up to AIORDMA_RXE_BOOT_TRIES.
        # A crash after the start is the command's and is reported, never retried.
        # (grep -c reads the whole console: grep -q could exit early and, with pipefail,
        # the writer's SIGPIPE would read as "not found".)
        started=$(clean_console < "$console" | grep -cE '^AIORDMA-RXE-(START|SETUP-FAILED)' || true)
        if [ "$qrc" != 124 ] && [ "$qrc" != 137 ] && [ "$try" -lt "$BOOT_TRIES" ] \
                && ! [ -s "$results/exit-code" ] && [ "${started:-0}" = 0 ]; then
            panic=$(clean_console < "$console" | grep -E 'Kernel panic|Oops' | tail -n 1 || true)
            log "boot $try of $BOOT_TRIES: the guest died before running the command${panic:+ ($panic)}; booting again"
            try=$((try + 1))
            continue
        fi
        break
    done
    local wall=$((SECONDS - t0))
    native_cache_keep "$results"

    local rc="" boot="" marker setup
    if [ -s "$results/exit-code" ]; then rc=$(tr -dc '0-9' < "$results/exit-code"); fi
    if [ -z "$rc" ]; then
        marker=$(clean_console < "$console" | grep -E '^AIORDMA-RXE-EXIT=[0-9]+$' | tail -n 1 || true)
        rc=${marker#AIORDMA-RXE-EXIT=}
    fi
    [ -s "$results/boot-seconds" ] && boot=$(cat "$results/boot-seconds")
    if [ -n "$rc" ]; then
        if [ "$quiet" = 1 ]; then    # the command's own output, without the boot
            if [ -f "$results/output.log" ]; then cat "$results/output.log"
            else echo "--- guest console (tail) ---"; clean_console < "$console" | tail -n 150; fi
        fi
        if [ -s "$results/timed-out" ]; then
            log "suite $SUITE: the guest command timed out after $(cat "$results/timed-out") s (AIORDMA_RXE_TIMEOUT=$TIMEOUT incl. boot); exit $rc"
        fi
        if [ "$rc" != 0 ] && [ -s "$results/kernel.log" ]; then
            echo "--- guest kernel log while the command ran (last 60 lines of $(
                [ -n "${AIORDMA_RXE_RESULTS:-}" ] && echo "$results/kernel.log" || echo kernel.log)) ---"
            tail -n 60 "$results/kernel.log"
        fi
        log "suite $SUITE: guest command exited $rc (guest boot-to-command ${boot:-?} s, wall ${wall} s)"
        exit "$rc"
    fi
    [ "$quiet" = 1 ] && { echo "--- guest console (tail) ---"; clean_console < "$console" | tail -n 150; }
    setup=$(clean_console < "$console" | grep -E '^AIORDMA-RXE-SETUP-FAILED: ' | tail -n 1 || true)
    if [ -n "$setup" ]; then
        die $EX_UNAVAILABLE "guest setup failed: ${setup#AIORDMA-RXE-SETUP-FAILED: }"
    fi
    if [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then
        die $EX_TIMEOUT "timed out after ${TIMEOUT} s (AIORDMA_RXE_TIMEOUT) without the guest's exit marker"
    fi
    local boots=""
    [ "$try" -gt 1 ] && boots=" (boot $try of $BOOT_TRIES; every one died before the command)"
    [ "$try" -gt 1 ] && [ "${started:-0}" != 0 ] && boots=" (boot $try of $BOOT_TRIES)"
    die $EX_NOMARKER "qemu exited ($qrc) without the AIORDMA-RXE-EXIT marker: the guest crashed or never ran the command$boots"
}

mkdir -p "$CACHE_ROOT"
case "$ACTION" in
    key) image_key; exit 0 ;;
    mirrors) mirror_candidates; exit 0 ;;
    build) ensure_image; echo "$IMG_DIR"; exit 0 ;;
    image) ensure_image; echo "$IMG_DIR"; exit 0 ;;
    run) ensure_image; run_vm ;;
esac
