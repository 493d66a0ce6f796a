"""Thin edge to the bpf() syscall through libbpf (ctypes): pinned maps, program stats.

Reading counters or changing the DSCP map must not need bcc (and its ~130 MB of LLVM), so
these go through libbpf's stable C API on the pinned objects. Errors become
turbonode.errors exceptions here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
import time
from collections.abc import Iterable

from turbonode.errors import BpfUnavailableError, DatapathError, NotRootError

BPF_STATS_RUN_TIME = 0
LIMIT = struct.Struct("=QI4x")  # struct tier_limit in bpf/classifier.c: until_ns, minor, pad

_lib: ctypes.CDLL | None = None


def _libbpf() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        name = ctypes.util.find_library("bpf") or "libbpf.so.1"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as exc:
            raise BpfUnavailableError(f"libbpf not found ({exc}): install libbpf1 (scripts/setup.sh)") from None
        lib.bpf_obj_get.argtypes = [ctypes.c_char_p]
        lib.bpf_map_lookup_elem.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.bpf_map_update_elem.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong]
        lib.bpf_enable_stats.argtypes = [ctypes.c_int]
        lib.bpf_prog_get_fd_by_id.argtypes = [ctypes.c_uint]
        _lib = lib
    return _lib


def _check(ret: int, what: str) -> int:
    if ret >= 0:
        return ret
    # libbpf >= 1.0 returns -errno; older ones return -1 and set errno.
    code = -ret if ret < -1 else ctypes.get_errno() or -ret
    if code in (errno.EPERM, errno.EACCES):
        raise NotRootError(f"{what}: {os.strerror(code)} (needs root)")
    if code == errno.ENOENT:
        raise DatapathError(f"{what}: not found")
    raise DatapathError(f"{what}: {os.strerror(code)}")


def possible_cpus(sysfs: str = "/sys") -> int:
    """Number of possible CPUs (the per-CPU value count), from 'possible' ranges like 0-3,5."""
    with open(os.path.join(sysfs, "devices/system/cpu/possible")) as f:
        total = 0
        for part in f.read().strip().split(","):
            lo, _, hi = part.partition("-")
            total += int(hi or lo) - int(lo) + 1
        return total


class PinnedMap:
    """A pinned BPF map opened by path; the fd is closed with close()."""

    def __init__(self, path: str, key_size: int = 4, value_size: int = 4, percpu: bool = False):
        self.path = path
        self.key_size = key_size
        self.value_size = value_size
        self.percpu = percpu
        self.fd = _check(_libbpf().bpf_obj_get(path.encode()), f"open pinned map {path}")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> PinnedMap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _value_buf(self) -> tuple[ctypes.Array[ctypes.c_char], int, int]:
        slot = (self.value_size + 7) & ~7  # per-CPU values are 8-byte aligned slots
        n = possible_cpus() if self.percpu else 1
        return ctypes.create_string_buffer(slot * n if self.percpu else self.value_size), slot, n

    def _lookup(self, key: int) -> tuple[bytes, int, int]:
        k = ctypes.c_uint32(key)
        buf, slot, n = self._value_buf()
        _check(_libbpf().bpf_map_lookup_elem(self.fd, ctypes.byref(k), buf), f"lookup key {key} in {self.path}")
        return buf.raw, slot, n

    def lookup(self, key: int) -> bytes:
        """The value's bytes (a map that is not per-CPU)."""
        return self._lookup(key)[0]

    def lookup_percpu(self, key: int) -> list[bytes]:
        """A per-CPU map's values, one per possible CPU."""
        raw, slot, n = self._lookup(key)
        return [raw[i * slot : i * slot + self.value_size] for i in range(n)]

    def update(self, key: int, value: bytes) -> None:
        if len(value) != self.value_size:
            raise ValueError(f"value for {self.path} must be {self.value_size} bytes")
        k = ctypes.c_uint32(key)
        buf = ctypes.create_string_buffer(value, len(value))
        _check(_libbpf().bpf_map_update_elem(self.fd, ctypes.byref(k), buf, 0), f"update key {key} in {self.path}")


def write_u32_array(path: str, values: Iterable[int]) -> None:
    with PinnedMap(path) as m:
        for i, v in enumerate(values):
            m.update(i, struct.pack("=I", v))


def read_u32_array(path: str, n: int) -> list[int]:
    with PinnedMap(path) as m:
        return [struct.unpack("=I", m.lookup(i))[0] for i in range(n)]


def read_counters(path: str, n: int) -> list[tuple[int, int]]:
    """(packets, bytes) per slot of a per-CPU array of {u64 packets; u64 bytes}, summed over CPUs."""
    out = []
    with PinnedMap(path, value_size=16, percpu=True) as m:
        for i in range(n):
            pk = by = 0
            for v in m.lookup_percpu(i):
                p, b = struct.unpack("=QQ", v)
                pk += p
                by += b
            out.append((pk, by))
    return out


def write_limit(path: str, index: int, until_ns: int, minor: int) -> None:
    """Entry `index` of a pinned struct tier_limit array: one map update, so the classifier
    sees the old entry or the new one."""
    with PinnedMap(path, value_size=LIMIT.size) as m:
        m.update(index, LIMIT.pack(until_ns, minor))


def read_limits(path: str, n: int) -> list[tuple[int, int]]:
    """(until_ns, minor) of each entry of a pinned struct tier_limit array."""
    with PinnedMap(path, value_size=LIMIT.size) as m:
        return [LIMIT.unpack(m.lookup(i)) for i in range(n)]


def kernel_clock_ns(procfs: str = "/proc") -> int:
    """Now on bpf_ktime_get_ns()'s clock: CLOCK_MONOTONIC of the initial time namespace. In
    another time namespace (`unshare --time`) this process's monotonic clock is shifted by the
    offset <procfs>/self/timens_offsets names; a lease deadline on the shifted clock would lapse
    that much late or early."""
    offset = 0
    try:
        with open(os.path.join(procfs, "self/timens_offsets")) as f:
            for line in f:
                name, secs, nsecs = line.split()
                if name == "monotonic":
                    offset = int(secs) * 1_000_000_000 + int(nsecs)
    except FileNotFoundError:  # a kernel without time namespaces: no offset
        pass
    return time.monotonic_ns() - offset


def enable_run_time_stats() -> int:
    """Turn on the kernel's per-program run_time_ns/run_cnt accounting while the returned fd
    stays open (BPF_ENABLE_STATS); close it to turn accounting off again."""
    return _check(_libbpf().bpf_enable_stats(BPF_STATS_RUN_TIME), "BPF_ENABLE_STATS")


def prog_fd_by_id(prog_id: int) -> int:
    return _check(_libbpf().bpf_prog_get_fd_by_id(prog_id), f"open BPF program id {prog_id}")


def prog_run_stats(prog_fd: int, procfs: str = "/proc") -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a program, from the fdinfo of an fd this process holds."""
    fields: dict[str, str] = {}
    with open(f"{procfs}/self/fdinfo/{prog_fd}") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    return int(fields.get("run_time_ns", 0)), int(fields.get("run_cnt", 0))


class _TestRunOpts(ctypes.Structure):
    """struct bpf_test_run_opts (libbpf)."""

    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("data_in", ctypes.c_void_p),
        ("data_out", ctypes.c_void_p),
        ("data_size_in", ctypes.c_uint32),
        ("data_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_void_p),
        ("ctx_out", ctypes.c_void_p),
        ("ctx_size_in", ctypes.c_uint32),
        ("ctx_size_out", ctypes.c_uint32),
        ("retval", ctypes.c_uint32),
        ("repeat", ctypes.c_int),
        ("duration", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
        ("batch_size", ctypes.c_uint32),
    ]


def prog_test_run(prog_fd: int, frame: bytes, repeat: int) -> tuple[int, int]:
    """BPF_PROG_TEST_RUN: run the program `repeat` times on `frame`; (retval, mean ns per run)."""
    frame = frame.ljust(64, b"\0")  # the kernel wants at least an Ethernet minimum frame
    buf = ctypes.create_string_buffer(frame, len(frame))
    opts = _TestRunOpts(
        sz=ctypes.sizeof(_TestRunOpts),
        data_in=ctypes.cast(buf, ctypes.c_void_p),
        data_size_in=len(frame),
        repeat=repeat,
    )
    lib = _libbpf()
    lib.bpf_prog_test_run_opts.argtypes = [ctypes.c_int, ctypes.c_void_p]
    _check(lib.bpf_prog_test_run_opts(prog_fd, ctypes.byref(opts)), "BPF_PROG_TEST_RUN")
    return opts.retval, opts.duration
