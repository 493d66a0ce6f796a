#!/usr/bin/env bash
# Set up turbonode on a Debian/Ubuntu machine, as root: system packages, kernel headers for
# bcc, bpffs/tracefs mounts, and a virtual environment (.venv) that sees Debian's bcc.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root: it installs packages, loads eBPF programs and mounts bpffs"

ARCH=$(dpkg --print-architecture)
KREL=$(uname -r)
PKGS=(python3-bpfcc python3-venv python3-dev iproute2 iperf3 stress-ng iputils-ping kmod prometheus haproxy redis-server
      systemd-container "linux-headers-$ARCH")
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# bcc compiles at load time against /lib/modules/$KREL/build. Prefer the running kernel's own
# headers; where the distribution has none for it, link the generic headers package (the
# programs use only stable UAPI: __sk_buff and tracepoint arguments).
if [ ! -e "/lib/modules/$KREL/build" ]; then
    if apt-get install -y -q --no-install-recommends "linux-headers-$KREL" >/dev/null 2>&1; then
        log "installed linux-headers-$KREL"
    else
        gen=$(ls -d /usr/src/linux-headers-*-"$ARCH" 2>/dev/null | sort -V | tail -n1 || true)
        common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n1 || true)
        [ -n "$gen" ] || die "no kernel headers for $KREL and no linux-headers-$ARCH: bcc cannot compile"
        log "no headers package for kernel $KREL: linking $gen (generic UAPI headers)"
        mkdir -p "/lib/modules/$KREL"
        ln -sfn "$gen" "/lib/modules/$KREL/build"
        [ -n "$common" ] && ln -sfn "$common" "/lib/modules/$KREL/source"
    fi
fi

mountpoint -q /sys/fs/bpf || { mount -t bpf bpf /sys/fs/bpf && log "mounted bpffs"; }
mountpoint -q /sys/kernel/tracing || { mount -t tracefs nodev /sys/kernel/tracing && log "mounted tracefs"; }

# The venv must come from Debian's interpreter: python3-bpfcc is built for it.
PY=/usr/bin/python3
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import bcc' 2>/dev/null; then
    log "creating .venv from $PY with system site packages"
    rm -rf .venv
    "$PY" -m venv --system-site-packages .venv
fi
. scripts/versions.sh
# torch first and pinned: the CPU wheel (scripts/versions.sh says why); the lock leaves it out.
if [ "$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" != "$TORCH_VERSION" ]; then
    log "installing torch $TORCH_VERSION (CPU)"
    .venv/bin/pip install -q --disable-pip-version-check "torch==$TORCH_VERSION"
fi
# Everything else from the lock, hashes checked, so every machine gets the same set
# (scripts/lock.sh regenerates it); turbonode itself then without resolving anything.
stamp=.venv/.turbonode-installed
if [ ! -f "$stamp" ] || [ requirements.lock -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    log "installing the locked dependencies (requirements.lock) and turbonode into .venv"
    .venv/bin/pip install -q --disable-pip-version-check --require-hashes -r requirements.lock
    .venv/bin/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
    touch "$stamp"
fi
.venv/bin/python -c 'import bcc, pyroute2, torch, diffusers' || die "the venv cannot import its dependencies"
log "ready: $(.venv/bin/python --version), turboctl at .venv/bin/turboctl"
