#!/usr/bin/env bash
# A real host to test on: a Debian 12 machine (kernel 6.1 with its own headers package,
# systemd 252 as PID 1, cgroup v2 only) booted under QEMU TCG, where scripts/host_vm_check.py
# installs turbonode as the README says and checks it, one line per check and a summary.
#
#   bash scripts/host_vm.sh [--dir DIR] [--rebuild] [--build-only] [--timeout SECONDS]
#
# Run as root on a Debian 12 machine. The image is built once with mmdebstrap and cached under
# DIR (default /var/tmp/turbonode-vm), keyed by its inputs (package list, recipe version,
# requirements.lock, pyproject.toml, scripts/setup.sh, scripts/versions.sh): a second run only
# boots. Each run boots a throwaway copy-on-write overlay of the image, shares this checkout
# read-only over 9p and gets the results back over another 9p share; it always powers the VM
# off (or kills qemu by its pid) and deletes its temporary files, also on failure or Ctrl-C.
# Exit status: 0 when every check passed, 1 otherwise. KVM is never used (nested KVM hangs on
# these machines); networking is QEMU's user mode only. Docs and figures: docs/host_vm.md.
set -euo pipefail
# The whole script is one function, read before any of it runs: editing this file while a run
# goes on (an image build takes minutes) cannot change what that run does next.
main() {
cd "$(dirname "$0")/.."
CHECKOUT=$(pwd)

DIR=/var/tmp/turbonode-vm
REBUILD=0
BUILD_ONLY=0
TIMEOUT=5400      # the whole boot + checks, seconds
SMP=2
MEM=3072
while [ $# -gt 0 ]; do
    case "$1" in
        --dir) DIR=$2; shift 2 ;;
        --rebuild) REBUILD=1; shift ;;
        --build-only) BUILD_ONLY=1; shift ;;
        --timeout) TIMEOUT=$2; shift 2 ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done

log() { printf '[host-vm] %s\n' "$*"; }
die() { printf '[host-vm] ERROR: %s\n' "$*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "run as root: mmdebstrap, chroot and the image need it"
case "$DIR" in "$CHECKOUT"|"$CHECKOUT"/*) die "--dir must lie outside the checkout" ;; esac

# Bump when the recipe below changes in a way the other inputs do not show.
RECIPE=1
SUITE=bookworm
MIRRORS=("deb http://deb.debian.org/debian $SUITE main"
         "deb http://deb.debian.org/debian $SUITE-updates main"
         "deb http://deb.debian.org/debian-security $SUITE-security main")
# The machine itself; scripts/setup.sh (run in the image) adds what turbonode needs.
# linux-headers-amd64 is the headers package of linux-image-amd64's kernel, version for version.
PACKAGES=systemd-sysv,udev,dbus,kmod,iproute2,procps,netbase,e2fsprogs,ca-certificates,linux-image-amd64,linux-headers-amd64,python3

need=()
for c in mmdebstrap:mmdebstrap qemu-system-x86_64:qemu-system-x86 qemu-img:qemu-utils mkfs.ext4:e2fsprogs \
         unshare:util-linux pip:python3-pip; do
    command -v "${c%%:*}" >/dev/null || need+=("${c#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
fi

# shellcheck source=scripts/versions.sh disable=SC1091 # shellcheck -x follows it
. scripts/versions.sh
KEY=$( { echo "$RECIPE $SUITE $PACKAGES ${MIRRORS[*]} torch=$TORCH_VERSION"
         cat requirements.lock pyproject.toml scripts/setup.sh scripts/versions.sh; } | sha256sum | cut -c1-16)
IMG_DIR=$DIR/image-$KEY
WHEELS=$DIR/wheels-$(cat requirements.lock scripts/versions.sh | sha256sum | cut -c1-16)
mkdir -p "$DIR"

# Everything temporary lives under $WORK; the trap removes it and stops qemu, whatever happened.
WORK=$(mktemp -d "$DIR/run.XXXXXX")
QEMU_PID=
TREE=
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ -n "$QEMU_PID" ] && kill -0 "$QEMU_PID" 2>/dev/null; then
        log "stopping qemu (pid $QEMU_PID)"
        kill -TERM "$QEMU_PID" 2>/dev/null || true
        for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$QEMU_PID" 2>/dev/null || break; sleep 1; done
        kill -KILL "$QEMU_PID" 2>/dev/null || true
        wait "$QEMU_PID" 2>/dev/null || true
    fi
    # The chroot's mounts lived in a private mount namespace and died with it; never delete
    # through a mount that is still there.
    for d in "$TREE" "$WORK"; do
        if [ -z "$d" ] || [ ! -d "$d" ]; then continue; fi
        if findmnt -rn -o TARGET | grep -q "^$d"; then
            log "not deleting $d: something is still mounted below it"
        else
            rm -rf --one-file-system "$d"
        fi
    done
    exit "$rc"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

# --- the wheelhouse: exactly requirements.lock plus torch, from this machine's pip config -----
# (its local torch CPU wheel and indexes); the image's chroot installs from it with no index.
if [ ! -f "$WHEELS/.complete" ]; then
    log "downloading the wheelhouse (requirements.lock + torch==$TORCH_VERSION) to $WHEELS"
    rm -rf "$WHEELS" && mkdir -p "$WHEELS.tmp"
    { pip download -q --disable-pip-version-check --only-binary=:all: --require-hashes -r requirements.lock -d "$WHEELS.tmp"
      pip download -q --disable-pip-version-check --only-binary=:all: "torch==$TORCH_VERSION" -d "$WHEELS.tmp"
    } 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
    [ -n "$(find "$WHEELS.tmp" -name "torch-$TORCH_VERSION*.whl")" ] || die "pip download got no torch $TORCH_VERSION wheel"
    touch "$WHEELS.tmp/.complete" && mv "$WHEELS.tmp" "$WHEELS"
fi

# --- the image ----------------------------------------------------------------------------
build_image() {
    local t0=$SECONDS krel
    TREE=$(mktemp -d "$DIR/tree.XXXXXX")
    log "mmdebstrap $SUITE minbase into $TREE"
    mmdebstrap --quiet --variant=minbase --include="$PACKAGES" "$SUITE" "$TREE" "${MIRRORS[@]}"
    krel=$(find "$TREE/lib/modules" -mindepth 1 -maxdepth 1 -name '*-amd64' -printf '%f\n' | sort -V | tail -n1)
    [ -n "$krel" ] || die "the image has no kernel under /lib/modules"
    [ -d "$TREE/usr/src/linux-headers-$krel" ] || die "the image has no linux-headers-$krel"
    log "kernel $krel with linux-headers-$krel; running scripts/setup.sh in the image (chroot)"

    # The checkout as a new user has it (no .venv, no caches), at /opt/turbonode as the units expect.
    mkdir -p "$TREE/opt/turbonode" "$TREE/var/tmp/wheels"
    tar -C "$CHECKOUT" --exclude=./.git --exclude=./.venv --exclude='__pycache__' --exclude='*.egg-info' \
        --exclude=./.mypy_cache --exclude=./.ruff_cache --exclude=./.pytest_cache -cf - . | tar -C "$TREE/opt/turbonode" -xf -
    cp -a "$WHEELS"/. "$TREE/var/tmp/wheels/"
    cp /etc/resolv.conf "$TREE/etc/resolv.conf"
    # No daemon a package installs may start in the chroot (it would run on this machine).
    printf '#!/bin/sh\nexit 101\n' > "$TREE/usr/sbin/policy-rc.d" && chmod 755 "$TREE/usr/sbin/policy-rc.d"
    # setup.sh asks uname -r for the kernel whose headers it installs: answer the image's.
    mkdir -p "$TREE/var/tmp/fakebin"
    # shellcheck disable=SC2016 # the $1 and $@ belong to the wrapper
    printf '#!/bin/sh\n[ "$1" = -r ] && { echo %s; exit 0; }\nexec /bin/uname "$@"\n' "$krel" > "$TREE/var/tmp/fakebin/uname"
    chmod 755 "$TREE/var/tmp/fakebin/uname"
    # A private mount namespace: proc, sysfs (and the bpffs/tracefs setup.sh mounts) vanish with it.
    # shellcheck disable=SC2016 # expanded by the inner shell
    unshare --mount --propagation private -- /bin/bash -euo pipefail -c '
        T=$1
        mount -t proc proc "$T/proc"; mount -t sysfs sysfs "$T/sys"; mount --rbind /dev "$T/dev"
        chroot "$T" /usr/bin/env -i HOME=/root PATH=/var/tmp/fakebin:/usr/sbin:/usr/bin:/sbin:/bin \
            LANG=C.UTF-8 PIP_NO_INDEX=1 PIP_FIND_LINKS=/var/tmp/wheels PIP_NO_CACHE_DIR=1 \
            /bin/bash -c "cd /opt/turbonode && bash scripts/setup.sh"
    ' _ "$TREE" 2>&1 | sed 's/^/[host-vm:chroot] /'
    rm -rf "$TREE/var/tmp/wheels" "$TREE/var/tmp/fakebin" "$TREE/usr/sbin/policy-rc.d"
    chroot "$TREE" apt-get clean
    [ -e "$TREE/lib/modules/$krel/build" ] || die "setup.sh left no /lib/modules/$krel/build"

    # The machine: name, root without password on the console, DHCP on QEMU's user network,
    # the check service (it runs scripts/host_vm_check.py from the shared checkout).
    echo turbonode-vm > "$TREE/etc/hostname"
    printf '127.0.0.1 localhost\n127.0.1.1 turbonode-vm\n' > "$TREE/etc/hosts"
    echo 'nameserver 10.0.2.3' > "$TREE/etc/resolv.conf"
    printf '/dev/vda / ext4 rw,errors=remount-ro 0 1\n' > "$TREE/etc/fstab"
    chroot "$TREE" passwd -d root >/dev/null
    printf '[Match]\nName=en*\n\n[Network]\nDHCP=ipv4\n' > "$TREE/etc/systemd/network/10-qemu-user.network"
    chroot "$TREE" systemctl enable systemd-networkd.service >/dev/null 2>&1
    cat > "$TREE/etc/systemd/system/turbonode-vmcheck.service" <<'EOF'
[Unit]
Description=turbonode host VM check (scripts/host_vm_check.py from the shared checkout)
After=multi-user.target

[Service]
Type=oneshot
ExecStartPre=/bin/mkdir -p /mnt/turbonode-src /mnt/turbonode-out
ExecStartPre=/bin/mount -t 9p -o trans=virtio,version=9p2000.L,ro tnsrc /mnt/turbonode-src
ExecStartPre=/bin/mount -t 9p -o trans=virtio,version=9p2000.L tnout /mnt/turbonode-out
ExecStart=/usr/bin/python3 /mnt/turbonode-src/scripts/host_vm_check.py --out /mnt/turbonode-out --src /mnt/turbonode-src
StandardOutput=journal+console
TimeoutStartSec=infinity

[Install]
WantedBy=multi-user.target
EOF
    chroot "$TREE" systemctl enable turbonode-vmcheck.service >/dev/null 2>&1

    local mb
    mb=$(( $(du -smx "$TREE" | cut -f1) + 3072 ))
    rm -rf "$IMG_DIR" && mkdir -p "$IMG_DIR.tmp"
    cp "$TREE/boot/vmlinuz-$krel" "$IMG_DIR.tmp/vmlinuz"
    cp "$TREE/boot/initrd.img-$krel" "$IMG_DIR.tmp/initrd.img"
    log "making a ${mb} MiB ext4 image"
    truncate -s "${mb}M" "$IMG_DIR.tmp/root.raw"
    mkfs.ext4 -q -L turbonode-root -d "$TREE" "$IMG_DIR.tmp/root.raw"
    rm -rf --one-file-system "$TREE"; TREE=
    printf 'key=%s\nkernel=%s\nbuilt=%s\nbuild_s=%s\n' "$KEY" "$krel" "$(date -u +%FT%TZ)" $((SECONDS - t0)) \
        > "$IMG_DIR.tmp/image.info"
    mv "$IMG_DIR.tmp" "$IMG_DIR"
    log "image built in $((SECONDS - t0)) s: $IMG_DIR"
}

if [ "$REBUILD" = 1 ] || [ ! -f "$IMG_DIR/image.info" ]; then
    rm -rf "$IMG_DIR.tmp"
    build_image
else
    log "cached image $IMG_DIR ($(grep -E '^(kernel|built|build_s)=' "$IMG_DIR/image.info" | tr '\n' ' '))"
fi

[ "$BUILD_ONLY" = 1 ] && exit 0

# --- boot and check ---------------------------------------------------------------------------
qemu-img create -q -f qcow2 -b "$IMG_DIR/root.raw" -F raw "$WORK/disk.qcow2"
mkdir -p "$WORK/out"
: > "$WORK/checks.log"
log "booting (TCG, -smp $SMP -m $MEM); checks follow (console: $DIR/last/console.log)"
T0=$SECONDS
qemu-system-x86_64 -accel tcg -cpu max -smp "$SMP" -m "$MEM" -nodefaults -no-user-config \
    -display none -vga none -monitor none \
    -kernel "$IMG_DIR/vmlinuz" -initrd "$IMG_DIR/initrd.img" \
    -append "root=/dev/vda rw console=ttyS0 systemd.show_status=1" \
    -drive "file=$WORK/disk.qcow2,format=qcow2,if=virtio" \
    -netdev user,id=n0 -device virtio-net-pci,netdev=n0 \
    -virtfs "local,path=$CHECKOUT,mount_tag=tnsrc,security_model=none,readonly=on" \
    -virtfs "local,path=$WORK/out,mount_tag=tnout,security_model=none" \
    -serial "file:$WORK/console.log" -serial "file:$WORK/checks.log" \
    </dev/null >"$WORK/qemu.log" 2>&1 &
QEMU_PID=$!

shown=0
while kill -0 "$QEMU_PID" 2>/dev/null; do
    if [ $((SECONDS - T0)) -ge "$TIMEOUT" ]; then
        log "timed out after $TIMEOUT s"
        break
    fi
    n=$(wc -l < "$WORK/checks.log")
    if [ "$n" -gt "$shown" ]; then sed -n "$((shown + 1)),${n}p" "$WORK/checks.log" | tr -d '\r'; shown=$n; fi
    sleep 2
done
n=$(wc -l < "$WORK/checks.log")
[ "$n" -gt "$shown" ] && sed -n "$((shown + 1)),${n}p" "$WORK/checks.log" | tr -d '\r'
wait "$QEMU_PID" 2>/dev/null || true
kill -0 "$QEMU_PID" 2>/dev/null || QEMU_PID=
mkdir -p "$DIR/last"
cp "$WORK/console.log" "$WORK/checks.log" "$WORK/qemu.log" "$DIR/last/" 2>/dev/null || true
cp -r "$WORK/out/." "$DIR/last/" 2>/dev/null || true
log "VM ran $((SECONDS - T0)) s; logs in $DIR/last"
[ -s "$WORK/out/summary" ] || die "the guest wrote no summary (see $DIR/last/console.log)"
cat "$WORK/out/summary"
grep -q '^failed=0$' "$WORK/out/summary"
}
main "$@"
