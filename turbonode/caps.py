"""The capabilities this process holds, so an error can name the one it lacks.

Running as root is not enough: a unit's CapabilityBoundingSet, a container or `setpriv` can
take capabilities from uid 0. tc needs CAP_NET_ADMIN, and entering a named network namespace
CAP_SYS_ADMIN; loading BPF programs and maps needs CAP_BPF, and a program the verifier checks
as privileged CAP_PERFMON (CAP_SYS_ADMIN grants both; kernels before 5.8 know only that one).
Read from <procfs>/self/status (CapEff), field by field; unreadable means unknown, and an
unknown capability is assumed held (the kernel's own error then speaks).
"""

from __future__ import annotations

import os

CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21
CAP_SYS_RESOURCE = 24  # PSI triggers with windows other than 2 s multiples (agent/watchers/psi.py)
CAP_PERFMON = 38
CAP_BPF = 39
NAMES = {CAP_NET_ADMIN: "CAP_NET_ADMIN", CAP_SYS_ADMIN: "CAP_SYS_ADMIN", CAP_PERFMON: "CAP_PERFMON", CAP_BPF: "CAP_BPF"}


def effective(procfs: str = "/proc") -> int | None:
    """The effective capability mask, or None when it cannot be read."""
    try:
        with open(os.path.join(procfs, "self", "status")) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == "CapEff":
                    return int(value.strip(), 16)
    except (OSError, ValueError):
        return None
    return None


def last_cap(procfs: str = "/proc") -> int | None:
    """The highest capability this kernel knows (CAP_BPF exists from 5.8 on)."""
    try:
        with open(os.path.join(procfs, "sys", "kernel", "cap_last_cap")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def has(cap: int, procfs: str = "/proc") -> bool:
    mask = effective(procfs)
    return mask is None or bool(mask >> cap & 1)


def missing_net_admin(procfs: str = "/proc") -> str | None:
    """'CAP_NET_ADMIN' when this process lacks it, else None."""
    return None if has(CAP_NET_ADMIN, procfs) else NAMES[CAP_NET_ADMIN]


def missing_sys_admin(procfs: str = "/proc") -> str | None:
    """'CAP_SYS_ADMIN' when this process lacks it (setns() into a named netns needs it), else None."""
    return None if has(CAP_SYS_ADMIN, procfs) else NAMES[CAP_SYS_ADMIN]


def _split_from_sys_admin(cap: int, procfs: str) -> str | None:
    """Name `cap` (CAP_BPF, CAP_PERFMON: split from CAP_SYS_ADMIN in 5.8, which still grants
    them) if this process lacks it, CAP_SYS_ADMIN on kernels before the split; None if held."""
    if has(CAP_SYS_ADMIN, procfs):
        return None
    top = last_cap(procfs)
    if top is not None and top < cap:
        return NAMES[CAP_SYS_ADMIN]
    return None if has(cap, procfs) else NAMES[cap]


def missing_bpf(procfs: str = "/proc") -> str | None:
    """The capability to ask for when this process may not load BPF programs and maps."""
    return _split_from_sys_admin(CAP_BPF, procfs)


def missing_perfmon(procfs: str = "/proc") -> str | None:
    """The capability to ask for when this process may not attach tracepoints."""
    return _split_from_sys_admin(CAP_PERFMON, procfs)


def missing_bpf_and_perfmon(procfs: str = "/proc") -> str | None:
    """What to ask for when this process may not load a program that does packet-pointer
    arithmetic (bpf/classifier.c): CAP_BPF for the program and its maps, and CAP_PERFMON, without
    which the verifier refuses that arithmetic ("prohibited for !root", EACCES). "CAP_BPF and
    CAP_PERFMON" when both lack, one CAP_SYS_ADMIN before Linux 5.8; None when nothing lacks."""
    names = dict.fromkeys(name for name in (missing_bpf(procfs), missing_perfmon(procfs)) if name)
    return " and ".join(names) or None


def lacks(cap_name: str, what: str) -> str:
    """The sentence an error carries: which capability `what` needs and that this process lacks it."""
    return (
        f"{what} needs {cap_name}, which this process does not have "
        f"(uid {os.geteuid()}; check the unit's CapabilityBoundingSet/AmbientCapabilities or how it was started)"
    )
