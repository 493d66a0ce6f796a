"""bpffs and tracefs: a fresh machine may have neither mounted (docs/design.md, kernel facts); mount them."""

from __future__ import annotations

import logging
import os
import subprocess

log = logging.getLogger("turbonode.agent")

MOUNTS = (("bpf", "bpf", "fs/bpf"), ("tracefs", "nodev", "kernel/tracing"))


def mounted_types(procfs: str = "/proc") -> dict[str, str]:
    """Mount point -> filesystem type, from <procfs>/self/mounts."""
    with open(os.path.join(procfs, "self", "mounts")) as f:
        return {fields[1]: fields[2] for fields in (line.split() for line in f) if len(fields) > 2}


def ensure_mounts(procfs: str = "/proc", sysfs: str = "/sys", dry_run: bool = False) -> dict[str, str | None]:
    """Mount what is missing; fstype -> None if present/mounted, else the reason it is not.
    In dry-run only say what would be mounted."""
    try:
        have = mounted_types(procfs)
    except OSError as exc:
        log.warning("cannot read %s/self/mounts (%s); not mounting bpffs/tracefs", procfs, exc.strerror)
        return {fstype: f"mount table unreadable: {exc.strerror}" for fstype, _, _ in MOUNTS}
    out: dict[str, str | None] = {}
    for fstype, source, rel in MOUNTS:
        target = os.path.join(sysfs, rel)
        if have.get(target) == fstype:
            out[fstype] = None
            continue
        if dry_run:
            out[fstype] = f"dry-run: would mount {fstype} at {target}"
            log.info("%s", out[fstype])
            continue
        proc = subprocess.run(["mount", "-t", fstype, source, target], capture_output=True, text=True)
        out[fstype] = None if proc.returncode == 0 else f"mount -t {fstype} {target}: {proc.stderr.strip()}"
        if out[fstype]:
            log.warning("%s", out[fstype])
        else:
            log.info("mounted %s at %s", fstype, target)
    return out
