"""Shared fixtures. Kernel tests run for real as root; they skip only where the machine cannot."""

from __future__ import annotations

import os
import shutil

import pytest


def _kernel_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, bpf)"
    if shutil.which("ip") is None:
        return "iproute2 'ip' not installed"
    if not os.path.isdir("/sys/fs/bpf"):
        return "no bpffs at /sys/fs/bpf (kernel without bpf syscall?)"
    return None


def _bcc_skip_reason() -> str | None:
    reason = _kernel_skip_reason()
    if reason:
        return reason
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc Python bindings (python3-bpfcc) not importable: run scripts/setup.sh"
    return None


KERNEL_SKIP = _kernel_skip_reason()
BCC_SKIP = _bcc_skip_reason()
needs_root = pytest.mark.skipif(KERNEL_SKIP is not None, reason=KERNEL_SKIP or "")
needs_bcc = pytest.mark.skipif(BCC_SKIP is not None, reason=BCC_SKIP or "")


@pytest.fixture
def sandbox():
    """Two fresh network namespaces joined by veth, deleted afterwards (also on failure)."""
    if KERNEL_SKIP:
        pytest.skip(KERNEL_SKIP)
    from sandbox.netns import Sandbox

    with Sandbox() as sb:
        yield sb
