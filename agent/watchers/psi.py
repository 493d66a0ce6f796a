"""Pressure stall information from /proc/pressure/{cpu,memory,io}.

Signals are stall fractions over the last sample (delta of `total` microseconds per second
of wall time), so they react within one sample rather than over avg10's 10 s. `full` for
cpu only exists since 5.13; a kernel without PSI has no /proc/pressure at all, which is a
reported failure of this watcher, not of the agent.
"""

from __future__ import annotations

import errno
import logging
import os
import select

from turbonode.config import PSI_WINDOW_US
from turbonode.errors import TurbonodeError

from .base import Rate, Watcher

RESOURCES = ("cpu", "memory", "io")
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

    def __init__(self, procfs: str = "/proc"):
        super().__init__()
        self.dir = os.path.join(procfs, "pressure")
        self._rate = Rate()

    def read(self, now):
        if not os.path.isdir(self.dir):
            raise TurbonodeError(f"{self.dir} missing: kernel without PSI (CONFIG_PSI, psi=1)")
        data, totals = {}, {}
        for res in RESOURCES:
            try:
                with open(os.path.join(self.dir, res)) as f:
                    data[res] = parse_pressure(f.read())
            except FileNotFoundError:
                continue
            for kind, values in data[res].items():
                totals[f"psi_{res}_{kind}"] = values["total"] / 1e6  # seconds stalled
        rates = self._rate.update(now, totals) or dict.fromkeys(totals)
        return rates, {res: {k: {"avg10": v.get("avg10")} for k, v in kinds.items()} for res, kinds in data.items()}


class PsiTriggers:
    """PSI triggers (Documentation/accounting/psi.rst): the kernel wakes poll() with POLLPRI
    when stall time within a window exceeds a threshold, so the sampler runs at once instead
    of at its next tick. Unavailable triggers (old kernel, no permission) are reported."""

    WINDOW_US = PSI_WINDOW_US

    def __init__(self, procfs: str = "/proc", stall_us: int = 100_000, resources=RESOURCES):
        self.fds: dict[int, str] = {}
        errors = []
        for res in resources:
            path = os.path.join(procfs, "pressure", res)
            try:
                fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
            except OSError as exc:
                errors.append(f"{res}: {exc.strerror}")
                continue
            try:
                os.write(fd, f"some {stall_us} {self.WINDOW_US}\0".encode())
            except OSError as exc:
                os.close(fd)
                why = (
                    "kernel without PSI trigger support"
                    if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP)
                    else exc.strerror
                )
                errors.append(f"{res}: trigger refused ({why})")
                continue
            self.fds[fd] = res
        self.error = "; ".join(errors) or None
        if self.error:
            log.info("PSI triggers: %s; sampling at the fixed period", self.error)

    def register(self, poller: select.poll) -> None:
        for fd in self.fds:
            poller.register(fd, select.POLLPRI)

    def fired(self, events: list[tuple[int, int]]) -> list[str]:
        return [self.fds[fd] for fd, ev in events if fd in self.fds and ev & select.POLLPRI]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
