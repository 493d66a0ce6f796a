"""A host's cgroup hierarchy, mounted again inside `ip netns exec`.

`ip netns exec` gives the program a mount namespace of its own and mounts a fresh /sys there
(for the namespace's network devices), which hides /sys/fs/cgroup. On a host the worker sees
its cgroups: it sizes its torch threads to their CPU quota (render/cpu_threads.py). So a sandbox
node's worker mounts the cpu hierarchy again first, the same one at the same place (cgroup2, or a
v1 mount with the same controllers, which the kernel attaches to the existing hierarchy), in its
own namespace only.
"""

from __future__ import annotations

import os
import shlex

from turbonode.cgroups import CGROUP_ROOT, Hierarchy


def remount(hierarchy: Hierarchy, root: str = CGROUP_ROOT) -> str:
    """A shell command that mounts `hierarchy` again where the host has it, under `root`
    (a tmpfs there first unless it is the root itself, as on a cgroup2-only host)."""
    real = os.path.realpath(hierarchy.mount)  # a v1 'cpu' is often a link to 'cpu,cpuacct'
    if hierarchy.version == 2 and real == os.path.realpath(root):
        return f"mount -t cgroup2 cgroup2 {shlex.quote(root)}"
    if hierarchy.version == 2:
        kind = "-t cgroup2 cgroup2"
    else:
        kind = f"-t cgroup -o {shlex.quote(os.path.basename(real))} cgroup"
    steps = [f"mount -t tmpfs cgroups {shlex.quote(root)}", f"mkdir -p {shlex.quote(real)}"]
    steps.append(f"mount {kind} {shlex.quote(real)}")
    if real != hierarchy.mount:
        steps.append(f"ln -s {shlex.quote(os.path.basename(real))} {shlex.quote(hierarchy.mount)}")
    return " && ".join(steps)


def seeing(hierarchy: Hierarchy | None, argv: list[str]) -> list[str]:
    """argv that mounts `hierarchy` again, then execs; where that fails it says so on stderr
    and runs all the same (the program then sees no cgroup, as before)."""
    if hierarchy is None:
        return argv
    failed = f"no cgroups here: the {hierarchy.controller} hierarchy did not mount"
    script = f'{{ {remount(hierarchy)}; }} || echo {shlex.quote(failed)} >&2; exec "$@"'
    return ["sh", "-c", script, "sh", *argv]
