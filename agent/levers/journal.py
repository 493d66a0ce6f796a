"""Reversible writes to kernel knob files (cgroup, sysctl, sysfs), journalled on disk.

Every lever changes the machine through `KnobJournal.set(path, value)`. Before the first
write to a file the journal records its original value in a JSON state file (written to a
temporary name, fsynced and renamed, so it is never half-written); `undo` writes the
original back. An agent killed with -9 leaves the state file behind: the next agent calls
`restore_leftovers()` at start and puts back every original whose file still holds the
value we wrote. A file someone else changed since is left alone (it is theirs now) and
reported, like a file that has gone (a removed cgroup, a deleted device), unless it was one
that goes with its process (/proc/PID/oom_score_adj: `vanishes`). A knob may be one line of a
'key value' file (v1's memory.oom_control takes "1" and reads back "oom_kill_disable 1 ...").
A per-device line (blkio.throttle.write_bps_device, io.max: `absent` set) is written as
"KEY VALUE" and reads as `absent` while the file has no line for KEY (no limit on that device);
the journal names it "FILE KEY", each device of a file a knob of its own.

Where a knob's value goes is its writer's to say (agent/levers/writers.py): the file itself, or
on a systemd host the property of the unit that owns the cgroup (a knob named
`systemd:UNIT:PROPERTY`). The journal only keeps the original and puts it back through the same
writer.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from typing import Protocol

from turbonode.errors import TurbonodeError

log = logging.getLogger("turbonode.agent")


class KnobError(TurbonodeError):
    """A knob file could not be read or written (missing, refused value, permission)."""


@dataclass
class Entry:
    original: str
    written: str
    key: str | None = None  # the line of a 'key value' file this knob is (None: the whole file)
    vanishes: bool = False  # the file goes with its process: gone is nothing to restore
    absent: str | None = None  # a per-device line: what a missing line means; written as 'KEY VALUE'
    file: str = ""  # a per-device line's file ('': the knob's name is its file)


def knob_name(path: str, key: str | None = None, absent: str | None = None) -> str:
    """The journal's name of a knob: its file, or for a per-device line 'FILE KEY'."""
    return path if absent is None else f"{path} {key}"


def read_knob(path: str, key: str | None = None, absent: str | None = None) -> str:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError as exc:
        raise KnobError(f"cannot read {path}: {exc.strerror or exc}") from None
    if key is None:
        return text
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return value.strip()
    if absent is not None:
        return absent
    raise KnobError(f"{path} has no {key!r} line")


def write_knob(path: str, value: str, key: str | None = None, absent: str | None = None) -> None:
    """Write `value` to `path`; a per-device line (`absent` set) as 'KEY VALUE'."""
    if absent is not None:
        value = f"{key} {value}"
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as exc:
        raise KnobError(f"cannot write {value!r} to {path}: {exc.strerror or exc}") from None


def same_value(a: str, b: str) -> bool:
    """Knob values compare by their fields: 'max 100000' == 'max  100000', '0001' == '1' for masks."""
    fa, fb = a.split(), b.split()
    if fa == fb:
        return True
    try:  # hex CPU masks are read back zero-padded and comma-grouped ("00000000,00000001")
        return int(a.replace(",", ""), 16) == int(b.replace(",", ""), 16)
    except ValueError:
        return False


class KnobWriter(Protocol):
    """Where a knob's value goes (agent/levers/writers.py): `route` names the knob that takes a
    write to `path` (itself, a unit property, or None: nothing to write), read/write apply it."""

    def route(
        self, path: str, value: str, key: str | None, absent: str | None
    ) -> tuple[str, str, str | None, str | None] | None: ...

    def read(self, path: str, key: str | None = None, absent: str | None = None) -> str: ...

    def write(self, path: str, value: str, key: str | None = None, absent: str | None = None) -> None: ...


class FileWriter:
    """The knob files themselves (writers.CgroupfsWriter without systemd)."""

    def route(
        self, path: str, value: str, key: str | None, absent: str | None
    ) -> tuple[str, str, str | None, str | None] | None:
        return path, value, key, absent

    def read(self, path: str, key: str | None = None, absent: str | None = None) -> str:
        return read_knob(path, key, absent)

    def write(self, path: str, value: str, key: str | None = None, absent: str | None = None) -> None:
        write_knob(path, value, key, absent)


class KnobJournal:
    """Knob files changed by this agent, with their originals, persisted at `state_path`."""

    def __init__(self, state_path: str, writer: KnobWriter | None = None):
        self.state_path = state_path
        self.writer: KnobWriter = writer or FileWriter()
        self.entries: dict[str, Entry] = {}

    # ---- changing and undoing --------------------------------------------------------

    def set(
        self, path: str, value: str, key: str | None = None, vanishes: bool = False, absent: str | None = None
    ) -> str:
        """Write `value` to `path` (where the writer routes it), remembering (on disk, first) what was
        there before; the knob's name."""
        routed = self.writer.route(path, value, key, absent)
        if routed is None:  # the writer's owner sets it from another knob: nothing of ours
            return knob_name(path, key, absent)
        path, value, key, absent = routed
        read, write = self.writer.read, self.writer.write
        name = knob_name(path, key, absent)
        entry = self.entries.get(name)
        before = entry.written if entry else None
        if entry is None:
            file = path if absent is not None else ""
            entry = self.entries[name] = Entry(read(path, key, absent), value, key, vanishes, absent, file)
        entry.written = value
        self._save()
        try:
            write(path, value, key, absent)
        except KnobError:
            if before is None:
                del self.entries[name]
            else:
                entry.written = before
            self._save()
            raise
        # the kernel may normalise what it stores (masks are padded): compare against what it reads back
        entry.written = read(path, key, absent)
        self._save()
        return name

    def undo(self, name: str) -> str | None:
        """Put the original of knob `name` back; returns why it could not be, or None."""
        entry = self.entries.get(name)
        if entry is None:
            return None
        problem = self._restore(name, entry)
        del self.entries[name]
        self._save()
        return problem

    def undo_all(self) -> list[str]:
        """Undo every change (newest first); the problems, one line each."""
        return [p for p in (self.undo(name) for name in reversed(list(self.entries))) if p]

    def changed(self) -> dict[str, dict[str, str]]:
        return {path: asdict(e) for path, e in self.entries.items()}

    # ---- after a crash ---------------------------------------------------------------

    def restore_leftovers(self) -> list[str]:
        """Restore what a previous agent left in the state file; the problems, one line each."""
        try:
            with open(self.state_path) as f:
                raw = json.load(f)
            left = {path: Entry(**e) for path, e in raw.items()}
        except FileNotFoundError:
            return []
        except (OSError, ValueError, TypeError) as exc:
            self._remove_state()
            return [f"{self.state_path}: unreadable state file ({exc}); nothing restored"]
        problems = []
        for path, entry in reversed(list(left.items())):
            problem = self._restore(path, entry)
            if problem:
                problems.append(problem)
            else:
                log.info("restored %s to %r (left changed by a previous agent)", path, entry.original)
        self._remove_state()
        return problems

    def _restore(self, name: str, entry: Entry) -> str | None:
        path = entry.file or name
        if entry.vanishes and not os.path.exists(path):
            return None  # its process has exited, and the value with it
        try:
            now = self.writer.read(path, entry.key, entry.absent)
            if same_value(now, entry.original):
                return None  # never written, or already back (a crash between saving and writing)
            if not same_value(now, entry.written):
                return f"{name}: left at {now!r} (changed by someone else since we wrote {entry.written!r})"
            self.writer.write(path, entry.original, entry.key, entry.absent)
        except KnobError as exc:
            return str(exc)
        return None

    # ---- the state file --------------------------------------------------------------

    def _save(self) -> None:
        if not self.entries:
            self._remove_state()
            return
        os.makedirs(os.path.dirname(self.state_path) or ".", exist_ok=True)
        tmp = f"{self.state_path}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(self.changed(), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.state_path)
        except OSError as exc:
            raise KnobError(f"cannot save the lever state file {self.state_path}: {exc.strerror or exc}") from None

    def _remove_state(self) -> None:
        try:
            os.unlink(self.state_path)
        except FileNotFoundError:
            pass


class KnobWrites:
    """The knobs one lever wrote through a shared journal (`paths`: their names), undone newest first."""

    def __init__(self, journal: KnobJournal):
        self.journal = journal
        self.paths: list[str] = []

    def set(
        self, path: str, value: str, key: str | None = None, vanishes: bool = False, absent: str | None = None
    ) -> None:
        name = self.journal.set(path, value, key, vanishes, absent)
        if name not in self.paths:
            self.paths.append(name)

    def written(self, path: str) -> str | None:
        """What we last wrote to `path` (as the kernel read it back), or None if we have not."""
        entry = self.journal.entries.get(path)
        return entry.written if entry is not None and path in self.paths else None

    def undo(self, path: str) -> str | None:
        if path in self.paths:
            self.paths.remove(path)
        return self.journal.undo(path)

    def undo_all(self) -> list[str]:
        return [p for p in (self.undo(path) for path in reversed(list(self.paths))) if p]
