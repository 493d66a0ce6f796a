#!/usr/bin/env bash
# Boot a real systemd in a container whose root is a throwaway overlay of this machine's root.
# tests/deploy/helpers.py (Container) runs it as
#   unshare --mount --propagation private -- bash systemd_container.sh CHECKOUT NETNS MACHINE SCRATCH CGROUP...
# so every mount below lives in a private mount namespace and vanishes with it: nothing the
# container writes reaches the host. The script ends by exec'ing systemd-nspawn (same pid).
# The container gets no bpffs or tracefs: turbonode-mounts.service mounts them inside it (a
# bpffs mounted there is an instance of its own, so the pins never reach the host's).
#   CHECKOUT  this repository; it appears at /opt/turbonode with its .venv relocated there
#   NETNS     network namespace file (/run/netns/NAME) the container runs in; never the host's
#   MACHINE   unique container name (hostname; nspawn's lock and state names)
#   SCRATCH   empty directory: a tmpfs is mounted on it (in this namespace only)
#   CGROUP    fresh cgroup directories (one per hierarchy) to run nspawn in: with --keep-unit it
#             puts the container in payload/ below its own cgroup, so two tests never share one
set -euo pipefail
checkout=$1 netns=$2 machine=$3 scratch=$4
shift 4
for cg in "$@"; do echo $$ > "$cg/cgroup.procs"; done

mount -t tmpfs -o mode=0755 turbonode-test "$scratch"
mkdir "$scratch"/{lower,upper,work,root,opt,opt-upper,opt-work}
touch "$scratch/netns"
# nspawn refuses --directory=/: overlay a tmpfs on a (non-recursive) bind of /.
mount --bind / "$scratch/lower"
mount -t overlay overlay -o "lowerdir=$scratch/lower,upperdir=$scratch/upper,workdir=$scratch/work" "$scratch/root"
# /opt/turbonode as docs/service.md installs it: the checkout, with the absolute paths that
# scripts/setup.sh wrote into its venv (script shebangs, the editable-install finder) pointing
# there, so the units run the code at /opt/turbonode wherever this checkout lives (even under
# /root or /home, which the units' ProtectHome= hides).
mount -t overlay overlay -o "lowerdir=$checkout,upperdir=$scratch/opt-upper,workdir=$scratch/opt-work" "$scratch/opt"
find "$scratch/opt/.venv/bin" "$scratch/opt/.venv/lib/"python3*/site-packages -maxdepth 1 -type f \
    \( -path '*/bin/*' -o -name '__editable__*' -o -name '*.pth' \) -print0 \
    | { xargs -0 grep -lIZF -- "$checkout" || true; } | xargs -0 -r sed -i "s|$checkout|/opt/turbonode|g"
# The network namespace, bound before /run is covered below.
mount --bind "$netns" "$scratch/netns"
# nspawn keeps locks and state under /run/systemd/nspawn: a tmpfs here keeps them off the host.
mount -t tmpfs -o mode=0755 turbonode-test-run /run

exec systemd-nspawn --quiet --directory="$scratch/root" --machine="$machine" --boot \
    --register=no --keep-unit --link-journal=no --console=read-only \
    --network-namespace-path="$scratch/netns" \
    --capability=CAP_BPF,CAP_PERFMON,CAP_NET_ADMIN,CAP_SYS_RESOURCE \
    --system-call-filter='bpf perf_event_open' \
    --bind="$scratch/opt:/opt/turbonode" \
    -- --unit=basic.target
