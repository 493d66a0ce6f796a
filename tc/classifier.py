"""Compile bpf/classifier.c with bcc, fill its pinned maps, attach it as the filter on 1:.

Compiling needs bcc and LLVM (~130 MB resident that never goes back to the OS), so the
datapath runs this in a short-lived child process (`python -m tc.classifier`): the caller
stays small, and the tc filter's own reference keeps the program running after the child
exits. The child reports one JSON line: {"prog_id": N} or {"error": kind, "message": ...}.
It dies with its parent (PR_SET_PDEATHSIG): an apply killed with -9 leaves no loader behind
to attach a program after the next apply or remove has run.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from turbonode.errors import BpfUnavailableError, DatapathError, NoDeviceError, NotRootError
from turbonode.tiers import BY_NAME, DEFAULT_TIER, TIERS

from . import bpfobj
from .tree import PROG_PREFIX, Tree

NTIERS = len(TIERS)
COUNTER_SLOTS = NTIERS + 1  # the last slot counts frames that could not be parsed
_ERRORS = {"bpf": BpfUnavailableError, "device": NoDeviceError, "root": NotRootError, "datapath": DatapathError}
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def prog_name() -> str:
    """TCA_BPF_NAME of our filter: names the source version, so a re-apply can tell whether
    the attached program is current (skip the compile) or must be swapped."""
    from bpf import source

    with open(source("classifier.c"), "rb") as f:
        digest = hashlib.sha256(f.read() + repr([(t.index, t.class_minor, t.limit_minor) for t in TIERS]).encode())
    return f"{PROG_PREFIX}{digest.hexdigest()[:12]}"


def pin_paths(pin_dir: str) -> dict[str, str]:
    return {name: os.path.join(pin_dir, name) for name in ("dscp_map", "tier_minor", "tier_limit", "counters")}


def write_tables(
    pin_dir: str, dscp_table: Sequence[int], tier_minors: Sequence[int], limit_minors: Sequence[int]
) -> None:
    """Program the pinned maps. Minors before DSCPs: a DSCP never points at an unset tier. The
    limits are written without a lease: apply lifts any limit in force."""
    paths = pin_paths(pin_dir)
    bpfobj.write_u32_array(paths["tier_minor"], tier_minors)
    for index, minor in enumerate(limit_minors):
        bpfobj.write_limit(paths["tier_limit"], index, 0, minor)
    bpfobj.write_u32_array(paths["dscp_map"], dscp_table)


def _prog_id(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("prog_id:"):
                return int(line.split(":")[1])
    raise DatapathError("kernel did not report the classifier's program id")


def load_and_attach(
    dev: str,
    netns: str | None,
    pin_dir: str,
    dscp_table: Sequence[int],
    tier_minors: Sequence[int],
    limit_minors: Sequence[int],
) -> int:
    """In this process: compile, load, fill maps, replace the filter. Returns the program id."""
    from bpf import source

    from .netlink import Link

    with Link(dev, netns) as link:  # first: a missing device fails before 0.4 s of compiling
        try:
            from bcc import BPF
        except ImportError:
            raise BpfUnavailableError(
                "bcc Python bindings not importable: install python3-bpfcc "
                "(scripts/setup.sh) and use a venv with system site packages"
            ) from None
        os.makedirs(pin_dir, exist_ok=True)
        default = BY_NAME[DEFAULT_TIER]
        cflags = [
            f'-DPIN_DIR="{pin_dir}"',
            f"-DNTIERS={NTIERS}",
            f"-DDEFAULT_TIER={default.index}",
            f"-DDEFAULT_MINOR={default.class_minor:#x}",
        ]
        try:
            b = BPF(src_file=source("classifier.c"), cflags=cflags)
            fn = b.load_func("classify", BPF.SCHED_CLS)
        except Exception as exc:  # bcc raises bare Exception for compile and load failures
            raise BpfUnavailableError(f"could not build the classifier: {exc}") from None
        write_tables(pin_dir, dscp_table, tier_minors, limit_minors)
        link.replace_bpf_filter(fn.fd, prog_name())
        return _prog_id(fn.fd)


def _headers_hint(stderr: str) -> str:
    if "kernel headers" in stderr or ("linux/" in stderr and "file not found" in stderr):
        return (
            "no kernel headers for bcc: install linux-headers-$(uname -r) or run scripts/setup.sh "
            "(links the generic headers)"
        )
    return ""


def attach_in_child(dev: str, netns: str | None, pin_dir: str, tree: Tree, timeout: float = 60) -> int:
    """Run load_and_attach in a child process; return the program id or raise its error."""
    request = {
        "parent_pid": os.getpid(),
        "dev": dev,
        "netns": netns,
        "pin_dir": pin_dir,
        "dscp_table": list(tree.dscp_table),
        "tier_minors": list(tree.tier_minors),
        "limit_minors": list(tree.limit_minors),
    }
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tc.classifier"],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        raise DatapathError(f"loading the classifier took longer than {timeout:.0f} s") from None
    lines = proc.stdout.strip().splitlines()
    try:
        reply = json.loads(lines[-1])
    except (IndexError, ValueError):
        hint = _headers_hint(proc.stderr)
        tail = proc.stderr.strip().splitlines()[-3:]
        raise BpfUnavailableError(hint or f"classifier loader failed: {' | '.join(tail)}") from None
    if "error" in reply:
        hint = _headers_hint(proc.stderr) if reply["error"] == "bpf" else ""
        raise _ERRORS.get(reply["error"], DatapathError)(hint or reply["message"])
    return int(reply["prog_id"])


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(1)


def _main() -> int:
    req = json.loads(sys.stdin.read())
    _die_with_parent(req["parent_pid"])
    kinds = {v: k for k, v in _ERRORS.items()}
    try:
        prog_id = load_and_attach(
            req["dev"], req["netns"], req["pin_dir"], req["dscp_table"], req["tier_minors"], req["limit_minors"]
        )
    except DatapathError as exc:
        kind = next((kinds[c] for c in type(exc).__mro__ if c in kinds), "datapath")
        print(json.dumps({"error": kind, "message": str(exc)}))
        return 1
    print(json.dumps({"prog_id": prog_id}))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
