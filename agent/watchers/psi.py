"""Pressure stall information from /proc/pressure/{cpu,memory,io}, and PSI triggers.

Signals are stall fractions over the last sample (delta of `total` microseconds per second
of wall time), so they react within one sample rather than over avg10's 10 s. `full` for
cpu only exists since 5.13; a kernel without PSI has no /proc/pressure at all, which is a
reported failure of this watcher, not of the agent.

Triggers (Documentation/accounting/psi.rst) make the kernel wake poll() with POLLPRI when
stall time within a window exceeds a threshold: the agent then samples at once instead of at
its next tick. The kernel takes a trigger of any window (0.5-10 s) from a writer with
CAP_SYS_RESOURCE and checks it every tenth of the window from a real-time thread; from anyone
else only windows that are a multiple of 2 s, checked by the averages work every 2 s
(kernel/sched/psi.c, psi_trigger_create). The unit grants the capability; without it the
agent arms 2 s windows and says so.
"""

from __future__ import annotations

import errno
import logging
import os
import select
from typing import Any

from turbonode import caps
from turbonode.config.policy import PSI_WINDOW_US
from turbonode.errors import TurbonodeError

from .base import MIN_RATE_WINDOW_S, Rate, Watcher
from .procfile import read_text

RESOURCES = ("cpu", "memory", "io")
UNPRIVILEGED_WINDOW_US = 2_000_000  # the only windows the kernel takes without CAP_SYS_RESOURCE: multiples of 2 s
log = logging.getLogger("turbonode.agent")


def parse_pressure(text: str) -> dict[str, dict[str, float]]:
    """'some avg10=0.12 avg60=... total=123' lines -> {'some': {'avg10': 0.12, ..., 'total': 123}}."""
    out = {}
    for line in text.splitlines():
        kind, *pairs = line.split()
        values = {}
        for pair in pairs:
            key, sep, raw = pair.partition("=")
            if sep:
                values[key] = float(raw)
        if "total" not in values:
            raise ValueError(f"PSI line without total: {line!r}")
        out[kind] = values
    return out


class PsiWatcher(Watcher):
    name = "psi"
    interval = MIN_RATE_WINDOW_S

    def __init__(self, procfs: str = "/proc", triggers: PsiTriggers | None = None):
        super().__init__()
        self.dir = os.path.join(procfs, "pressure")
        self._rate = Rate()
        self.triggers = triggers

    def read(self, now):
        if not os.path.isdir(self.dir):
            raise TurbonodeError(f"{self.dir} missing: kernel without PSI (CONFIG_PSI, psi=1)")
        data, totals = {}, {}
        for res in RESOURCES:
            try:
                data[res] = parse_pressure(read_text(os.path.join(self.dir, res)))
            except FileNotFoundError:
                continue
            for kind, values in data[res].items():
                totals[f"psi_{res}_{kind}"] = values["total"] / 1e6  # seconds stalled
        rates = self._rate.update(now, totals) or dict.fromkeys(totals)
        return rates, {res: {k: {"avg10": v.get("avg10")} for k, v in kinds.items()} for res, kinds in data.items()}

    def wake_fds(self) -> dict[int, int]:
        return {fd: select.POLLPRI for fd in self.triggers.fds} if self.triggers else {}

    def summary(self) -> dict:
        return {**super().summary(), "triggers": self.triggers.describe() if self.triggers else None}

    def close(self) -> None:
        if self.triggers:
            self.triggers.close()


def _refusal(exc: OSError, window_us: int, privileged: bool | None) -> str:
    """Why the kernel refused a trigger, as precisely as its errno says."""
    if exc.errno == errno.EOPNOTSUPP:
        return "PSI is disabled in this kernel (psi=0)"
    if exc.errno == errno.EINVAL:
        if not privileged and window_us % UNPRIVILEGED_WINDOW_US:
            return f"EINVAL: a {window_us / 1e6:g} s window needs CAP_SYS_RESOURCE"
        return f"EINVAL for a {window_us / 1e6:g} s window: a kernel before 5.2 has no triggers"
    return exc.strerror or str(exc)


class PsiTriggers:
    """One `some` trigger per resource; `fds` maps each armed one's fd to its resource."""

    def __init__(self, procfs: str = "/proc", stall_us_per_s: int = 100_000, resources=RESOURCES):
        self.fds: dict[int, str] = {}
        mask = caps.effective(procfs)
        self.privileged = None if mask is None else bool(mask >> caps.CAP_SYS_RESOURCE & 1)
        # Without the capability only 2 s windows are taken; with it (or not knowing) 1 s, and 2 s
        # should the kernel refuse that.
        self.windows_us = (
            (UNPRIVILEGED_WINDOW_US,) if self.privileged is False else (PSI_WINDOW_US, UNPRIVILEGED_WINDOW_US)
        )
        self.stall_us_per_s = stall_us_per_s
        self.window_us: int | None = None
        self.window_why: str | None = None  # why the window is longer than PSI_WINDOW_US
        errors = []
        for res in resources:
            err = self._arm(os.path.join(procfs, "pressure", res), res)
            if err:
                errors.append(f"{res}: {err}")
        self.error = "; ".join(errors) or None
        if self.error:
            log.warning("PSI triggers: %s", self.error)
        if self.fds:
            log.info("PSI triggers armed on %s: %s", ", ".join(self.fds.values()), self.describe()["window"])

    def _arm(self, path: str, res: str) -> str | None:
        """Open `path` and arm a trigger on it; the reason it could not be, or None."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return f"no {path} (kernel without PSI)"
        except OSError as exc:
            return f"cannot open {path} for writing: {exc.strerror or exc}"
        why = ""
        for window in self.windows_us:
            spec = f"some {self.stall_us_per_s * window // 1_000_000} {window}"
            try:
                os.write(fd, spec.encode() + b"\0")
            except OSError as exc:
                why = f"trigger '{spec}' refused: {_refusal(exc, window, self.privileged)}"
                if exc.errno == errno.EINVAL:
                    continue  # a longer window may still be taken
                break
            self.fds[fd] = res
            self.window_us = window
            if window != PSI_WINDOW_US:
                self.window_why = (
                    "no CAP_SYS_RESOURCE: the kernel takes only 2 s multiples from this process, checked every 2 s"
                    if self.privileged is False
                    else f"the kernel refused {PSI_WINDOW_US / 1e6:g} s ({why})"
                )
            return None
        os.close(fd)
        return why

    def describe(self) -> dict[str, Any]:
        """What `turboctl status` shows: the window in force and why, what is armed, what failed."""
        window = None if self.window_us is None else f"{self.window_us / 1e6:g} s"
        if window and self.window_why:
            window += f" ({self.window_why})"
        return {"armed": sorted(set(self.fds.values())), "window": window, "error": self.error}

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
