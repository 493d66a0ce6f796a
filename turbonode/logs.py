"""Logging for turboctl and the daemons, with journald priorities when stderr is the journal.

systemd connects a service's stderr to journald and sets JOURNAL_STREAM to that stream's
"device:inode". journald files every line at the unit's default priority (info) unless the line
starts with an sd-daemon prefix "<N>" (SyslogLevelPrefix=yes, the default), and each line of a
multi-line record is an entry of its own: so every line carries its record's priority, and
`journalctl -p warning` / `-p err` show warnings and errors. Elsewhere lines are plain, with a
timestamp (the journal stamps its own).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from types import TracebackType
from typing import IO

# syslog priorities (sd-daemon.h: SD_CRIT, SD_ERR, SD_WARNING, SD_INFO, SD_DEBUG)
CRIT, ERR, WARNING, INFO, DEBUG = 2, 3, 4, 6, 7

PLAIN_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
JOURNAL_FORMAT = "%(name)s %(levelname)s %(message)s"
HANDLER_NAME = "turbonode"  # the root handler setup() owns and replaces on a second call
_lifecycle: set[str] = set()  # loggers show_lifecycle() raised; setup() resets them

log = logging.getLogger("turbonode")


def syslog_priority(levelno: int) -> int:
    """The syslog priority of a logging level; a level between two takes the lower one's."""
    for floor, priority in (
        (logging.CRITICAL, CRIT),
        (logging.ERROR, ERR),
        (logging.WARNING, WARNING),
        (logging.INFO, INFO),
    ):
        if levelno >= floor:
            return priority
    return DEBUG


def prefix_lines(text: str, priority: int) -> str:
    """`text` with the sd-daemon prefix on every line (journald reads each line on its own)."""
    return "\n".join(f"<{priority}>{line}" for line in text.split("\n"))


def stream_is_journal(stream: IO[str], env: dict[str, str] | None = None) -> bool:
    """Is `stream` the journal stream systemd set up (JOURNAL_STREAM names its device:inode)?

    Compared, not just present: a daemon's child that inherits the variable but writes to a pipe
    or a terminal must not send prefixes there."""
    dev, _, ino = (env if env is not None else os.environ).get("JOURNAL_STREAM", "").partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):  # closed, or no file behind it (StringIO: ValueError)
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


class JournalFormatter(logging.Formatter):
    """Each line of the formatted record (traceback included) prefixed with its priority."""

    def format(self, record: logging.LogRecord) -> str:
        return prefix_lines(super().format(record), syslog_priority(record.levelno))


def setup(level: int, stream: IO[str] | None = None, env: dict[str, str] | None = None) -> bool:
    """Log to `stream` (stderr) at `level`, with priorities if it is the journal; True if it is.

    Idempotent: a second call replaces the handler of the first and undoes show_lifecycle()
    (CliRunner invokes the CLI many times in one process), and leaves other handlers (pytest's)
    alone. Under the journal, Python
    warnings and uncaught exceptions go through logging too, so they carry a priority."""
    stream = stream if stream is not None else sys.stderr
    journal = stream_is_journal(stream, env)
    handler = logging.StreamHandler(stream)
    handler.name = HANDLER_NAME
    handler.setFormatter(JournalFormatter(JOURNAL_FORMAT) if journal else logging.Formatter(PLAIN_FORMAT))
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.name == HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    while _lifecycle:  # a previous command's daemon levels (CliRunner: one process, many commands)
        logging.getLogger(_lifecycle.pop()).setLevel(logging.NOTSET)
    if journal:
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_thread_exception
    return journal


def show_lifecycle(*names: str) -> None:
    """A daemon's lifecycle events are logged at INFO: show those of loggers `names` even when
    the root level is WARNING (turboctl's default); -v/-vv still lower it further."""
    for name in names:
        logging.getLogger(name).setLevel(min(logging.getLogger().level, logging.INFO))
        _lifecycle.add(name)


def _log_uncaught(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    log.critical("uncaught exception", exc_info=(exc_type, exc, tb))


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit or args.exc_value is None:
        return
    name = args.thread.name if args.thread is not None else "?"
    log.error("uncaught exception in thread %s", name, exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
