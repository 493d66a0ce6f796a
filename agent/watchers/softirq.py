"""Softirq time and latency per vector from eBPF tracepoints (bpf/softirq.c).

Signals: NET_RX raise-to-entry latency p99 over the last sample, and the busiest CPU's share
of time spent in NET_RX (on veth and other software paths the raise is served within
microseconds even during a flood, so the time share is what shows a storm there). Where BPF
cannot be used (no bcc, no tracepoints, no headers) the watcher falls back to /proc/softirqs
counts and says so; its collector then reports failure because the counts alone are
node_exporter's business.
"""

from __future__ import annotations

import ctypes
import errno
import os

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from turbonode import caps
from turbonode.errors import TurbonodeError

from .base import MIN_RATE_WINDOW_S, Rate, Watcher
from .softirqs_proc import read_softirqs

# The kernel's softirq vectors in index order (NR_SOFTIRQS of them) and the latency histogram's
# log2(ns) slots (up to ~2 s, then one open-ended slot): bpf/softirq.c gets both as cflags.
VECTORS = ("HI", "TIMER", "NET_TX", "NET_RX", "BLOCK", "IRQ_POLL", "TASKLET", "SCHED", "HRTIMER", "RCU")
NET_RX = VECTORS.index("NET_RX")
NR_SLOTS = 32
CFLAGS = [f"-DNR_VEC={len(VECTORS)}", f"-DNR_SLOTS={NR_SLOTS}"]
TRACEPOINTS = ("softirq_raise", "softirq_entry", "softirq_exit")
MIN_EVENTS_FOR_P99 = 10  # fewer raises in a sample say nothing about a tail


class BpfUnavailable(TurbonodeError):
    pass


def slot_bounds(slot: int) -> tuple[float, float]:
    """Nanosecond range [lo, hi) of a log2 slot (bcc's bpf_log2l: slot s holds [2^(s-1), 2^s))."""
    return (0.0, 1.0) if slot == 0 else (float(2 ** (slot - 1)), float(2**slot))


def quantile(counts: list[int], q: float) -> float | None:
    """q-quantile in seconds of a log2 ns histogram, interpolated inside its slot."""
    total = sum(counts)
    if total == 0:
        return None
    rank, seen = q * total, 0
    for slot, n in enumerate(counts):
        if n and seen + n >= rank:
            lo, hi = slot_bounds(slot)
            return (lo + (hi - lo) * (rank - seen) / n) / 1e9
        seen += n
    return slot_bounds(len(counts) - 1)[1] / 1e9


def tracefs_dirs(sysfs: str) -> list[str]:
    return [os.path.join(sysfs, "kernel", "tracing"), os.path.join(sysfs, "kernel", "debug", "tracing")]


def missing_tracepoints(sysfs: str = "/sys") -> list[str]:
    """Tracepoints absent from tracefs (all of them when tracefs is not mounted)."""
    for base in tracefs_dirs(sysfs):
        if os.path.isdir(os.path.join(base, "events")):
            return [tp for tp in TRACEPOINTS if not os.path.isdir(os.path.join(base, "events", "irq", tp))]
    return [f"irq:{tp}" for tp in TRACEPOINTS] + ["(tracefs not mounted)"]


class SoftirqBpf:
    """The loaded probe: thin reader over its per-CPU maps."""

    def __init__(self, sysfs: str = "/sys"):
        missing = missing_tracepoints(sysfs)
        if missing:
            raise BpfUnavailable(f"tracepoints missing: {', '.join(missing)}")
        cap = caps.missing_bpf() or caps.missing_perfmon()
        if cap:  # bcc would only say "Failed to compile BPF module"
            raise BpfUnavailable(caps.lacks(cap, "loading the softirq tracepoint probes"))
        try:
            from bcc import BPF
        except ImportError as exc:
            raise BpfUnavailable(f"bcc not importable ({exc}); install python3-bpfcc") from None
        import bpf

        try:  # bcc raises bare Exception for compile/load/attach failures
            self.bpf = BPF(src_file=bpf.source("softirq.c"), cflags=CFLAGS)
        except Exception as exc:
            raise BpfUnavailable(f"loading bpf/softirq.c failed: {exc}") from None
        self._time, self._runs, self._lat = self.bpf[b"time_ns"], self.bpf[b"runs"], self.bpf[b"latency"]
        # one vector's histogram as the batch lookup fills it: its slots, each per CPU
        self._ncpu = self._lat.total_cpu
        self._slot_keys = (ctypes.c_uint32 * NR_SLOTS)()
        self._slot_values = (ctypes.c_uint64 * (NR_SLOTS * self._ncpu))()
        self.batch_error: str | None = None  # why the histogram is read slot by slot (a kernel before 5.7)

    @staticmethod
    def _per_cpu(table, key: int) -> list[int]:
        return list(table[ctypes.c_int(key)])

    def _batch_latency(self, vec: int) -> list[int]:
        """latency(vec) in one BPF_MAP_LOOKUP_BATCH: a lookup per slot is a syscall and a ctypes
        round trip each, 32 of them every sample. On an array the batch starts after the key it is
        given (none: at key 0)."""
        from bcc.libbcc import lib

        first = vec * NR_SLOTS
        after, last, count = ctypes.c_uint32(first - 1), ctypes.c_uint32(0), ctypes.c_uint32(NR_SLOTS)
        res = lib.bpf_lookup_batch(
            self._lat.map_fd,
            ctypes.byref(after) if first else None,
            ctypes.byref(last),
            self._slot_keys,
            self._slot_values,
            ctypes.byref(count),
        )
        err = ctypes.get_errno()
        if (res != 0 and err != errno.ENOENT) or count.value != NR_SLOTS:
            raise OSError(err, f"BPF_MAP_LOOKUP_BATCH on the latency map: {os.strerror(err)}, {count.value} slots")
        values, n = self._slot_values, self._ncpu
        return [sum(values[s * n : (s + 1) * n]) for s in range(NR_SLOTS)]

    def time_ns(self, vec: int) -> list[int]:
        """Nanoseconds per CPU spent in vector `vec`."""
        return self._per_cpu(self._time, vec)

    def runs(self, vec: int) -> list[int]:
        return self._per_cpu(self._runs, vec)

    def latency(self, vec: int) -> list[int]:
        """Cumulative raise-to-entry histogram of `vec`, summed over CPUs."""
        if self.batch_error is None:
            try:
                return self._batch_latency(vec)
            except OSError as exc:
                self.batch_error = str(exc)
        return [sum(self._per_cpu(self._lat, vec * NR_SLOTS + s)) for s in range(NR_SLOTS)]

    def close(self) -> None:
        self.bpf.cleanup()


class SoftirqWatcher(Watcher):
    name = "softirq"
    interval = MIN_RATE_WINDOW_S

    def __init__(self, procfs: str = "/proc", sysfs: str = "/sys", use_bpf: bool = True):
        super().__init__()
        self.procfs = procfs
        self.probe: SoftirqBpf | None = None
        self.bpf_error: str | None = "disabled"
        if use_bpf:
            try:
                self.probe = SoftirqBpf(sysfs)
                self.bpf_error = None
            except BpfUnavailable as exc:
                self.bpf_error = str(exc)
        self._rate = Rate()
        self._last_hist: list[int] | None = None

    @property
    def mode(self) -> str:
        return "bpf" if self.probe else "procfs"

    def read(self, now):
        if self.probe is None:
            counts = read_softirqs(self.procfs).get("NET_RX", {})
            rates = self._rate.update(now, {"netrx": sum(counts.values())})
            signals = {"netrx_per_s": rates and rates["netrx"], "netrx_latency_p99_s": None}
            return signals, {"mode": "procfs", "bpf_error": self.bpf_error}
        hist = self.probe.latency(NET_RX)
        per_cpu = self.probe.time_ns(NET_RX)
        counters = {cpu: ns / 1e9 for cpu, ns in enumerate(per_cpu)}
        counters["runs"] = sum(self.probe.runs(NET_RX))
        rates = self._rate.update(now, counters)
        last, self._last_hist = self._last_hist, hist
        p99 = None
        if last is not None:
            delta = [max(0, a - b) for a, b in zip(hist, last)]
            if sum(delta) >= MIN_EVENTS_FOR_P99:
                p99 = quantile(delta, 0.99)
        shares = [rates[cpu] for cpu in range(len(per_cpu))] if rates else None
        signals = {
            "netrx_latency_p99_s": p99,
            # A storm pins one CPU's NET_RX: the busiest CPU's share of time in the handler.
            "netrx_cpu_share": max(shares) if shares else None,
            "netrx_per_s": rates and rates["runs"],
        }
        return signals, {"mode": "bpf", "netrx_cpu_share_per_cpu": shares}

    def summary(self) -> dict:
        batch = self.probe.batch_error if self.probe else None  # the histogram read slot by slot: why
        return {**super().summary(), "mode": self.mode, "bpf_error": self.bpf_error, "bpf_batch_error": batch}

    def collector_ok(self) -> bool:
        return self.ok and self.probe is not None

    def families(self):
        if self.probe is None:
            return []
        secs = CounterMetricFamily(
            "turbonode_softirq_seconds", "Time spent in softirq handlers, from eBPF", labels=["vector", "cpu"]
        )
        lat = HistogramMetricFamily(
            "turbonode_softirq_latency_seconds",
            "Softirq raise-to-entry latency, from eBPF (log2 buckets)",
            labels=["vector"],
        )
        for vec, name in enumerate(VECTORS):
            for cpu, ns in enumerate(self.probe.time_ns(vec)):
                secs.add_metric([name, str(cpu)], ns / 1e9)
            counts = self.probe.latency(vec)
            buckets, acc = [], 0
            for slot, n in enumerate(counts[:-1]):
                acc += n
                buckets.append((repr(slot_bounds(slot)[1] / 1e9), acc))
            buckets.append(("+Inf", acc + counts[-1]))
            # Sum is unknown from a log2 histogram: estimate it from bucket midpoints.
            est = sum(n * sum(slot_bounds(s)) / 2 for s, n in enumerate(counts)) / 1e9
            lat.add_metric([name], buckets, est)
        return [secs, lat]

    def close(self) -> None:
        if self.probe:
            self.probe.close()
            self.probe = None
