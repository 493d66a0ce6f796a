"""Kernel files the agent reads every sample (/proc/stat, /proc/pressure/*, a worker's
/proc/PID/stat), each kept open and read again from offset 0.

procfs and cgroupfs make a file's text anew on each read from offset 0, so one open file gives
fresh values without an open(), a text wrapper and a close() per read: 1.1 against 6.0 µs a
read of /proc/PID/stat on the 2-core VM, where the agent reads a dozen such files every 100 ms.
A /proc/PID/stat kept open also stays the process it was opened for: once that exits, reads
fail (ESRCH) rather than show another process that reused the pid.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

READ_SIZE = 4096  # a first read this large; a file that fills it is read again with twice as much


class ProcFile:
    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        self._size = READ_SIZE

    def read(self) -> str:
        """The file's text now. Raises OSError as open() and read() would; after a failed read
        the file is opened again at the next one (a file that came back, a pid's new process)."""
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            while True:
                data = os.pread(self._fd, self._size, 0)
                if len(data) < self._size:
                    return data.decode(errors="replace")  # a command name may be any bytes
                self._size *= 2
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def process_stat_fields(text: str) -> list[str]:
    """The fields of a /proc/PID/stat line from its third (state) on. The command name in
    parentheses may hold spaces and parentheses itself: fields are counted after the last ')'."""
    return text[text.rindex(")") + 2 :].split()


class WorkerProcesses:
    """The workers' processes (pids as their statuses name them) as /proc/PID/stat shows them,
    read once per sample whichever watchers ask: the cpu watcher takes their CPU time, the memory
    watcher their major faults. Each process's file stays open while its pid is named."""

    def __init__(self, procfs: str = "/proc", pids: Callable[[], Iterable[int]] = tuple):
        self.procfs, self.pids = procfs, pids
        self._files: dict[int, ProcFile] = {}
        self._sample: tuple[float, dict[int, list[str]]] | None = None

    def stat(self, now: float) -> dict[int, list[str]]:
        """{pid: the fields of its stat line from the state on} of each named process that can be
        read, in the order named; read once for the sample taken at `now`."""
        if self._sample is not None and self._sample[0] == now:
            return self._sample[1]
        files: dict[int, ProcFile] = {}
        out: dict[int, list[str]] = {}
        for pid in dict.fromkeys(self.pids()):  # each once, in order
            f = files[pid] = self._files.pop(pid) if pid in self._files else ProcFile(self._path(pid))
            try:
                out[pid] = process_stat_fields(f.read())
            except (OSError, ValueError):  # gone, or not a stat line: not the worker's
                continue
        self.close()  # the pids no longer named
        self._files, self._sample = files, (now, out)
        return out

    def _path(self, pid: int) -> str:
        return os.path.join(self.procfs, str(pid), "stat")

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}
