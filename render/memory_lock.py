"""Keep the worker's pages resident while the agent asks (`lock_memory` in its throttle).

Under reclaim, the kernel drops file-backed pages first, and the worker's are among them: the code
of libtorch and Python, its mapped files. Each step then faults them back in (a major fault: a
read from disk), and turbo's latency goes with it. mlockall(MCL_CURRENT | MCL_ONFAULT) marks every
mapping the process has as locked: what is resident stays, and what was already dropped is locked
as it faults back, without reading in the parts of the libraries it never uses (no MCL_FUTURE:
new mappings are the step's anonymous memory, which reclaim cannot take without swap anyway).
munlockall undoes it when the throttle no longer asks, is released, or expires: a dead agent's
lock lapses with its lease. cgroup v1 has no other way to keep a cgroup's pages from reclaim (v2
has memory.min, which the agent sets too: agent/levers/memory.py).

Locking needs CAP_IPC_LOCK or an RLIMIT_MEMLOCK above the process's mappings (the worker's unit
sets LimitMEMLOCK=infinity); a refusal is reported in the worker's status and log, never fatal.
Both worker processes apply it: the engine in its loop, the front on its throttle changes and
every MemoryLock.PERIOD_S.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os

log = logging.getLogger(__name__)

MCL_CURRENT, MCL_ONFAULT = 1, 4  # <sys/mman.h>
_libc = ctypes.CDLL(None, use_errno=True)


class MemoryLock:
    PERIOD_S = 1.0  # the front checks its throttle's expiry this often

    def __init__(self, name: str):
        self.name = name  # the process, for the log
        self.locked = False
        self.error: str | None = None

    def apply(self, want: bool) -> None:
        """Lock or unlock this process's pages so that they match `want`; idempotent."""
        if want == self.locked:
            return
        rc = _libc.mlockall(MCL_CURRENT | MCL_ONFAULT) if want else _libc.munlockall()
        if rc != 0:
            code = ctypes.get_errno()
            why = os.strerror(code)
            if want and code in (errno.ENOMEM, errno.EPERM):
                why += " (needs CAP_IPC_LOCK or LimitMEMLOCK=infinity)"
            if self.error != why:
                log.warning("%s: cannot %s its memory: %s", self.name, "lock" if want else "unlock", why)
            self.error = why
            return
        self.locked, self.error = want, None
        log.info(
            "%s: memory %s",
            self.name,
            "locked (resident pages stay, dropped ones lock as they return)" if want else "unlocked",
        )

    def status(self) -> dict:
        return {"locked": self.locked, "error": self.error}
