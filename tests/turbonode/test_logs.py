"""turbonode.logs: sd-daemon priority prefixes when stderr is the journal, plain lines elsewhere.

The journal itself is checked in tests/deploy/test_systemd_units.py (journalctl -p err/-p warning in a
container booted with a real systemd); these tests pin the prefix logic it relies on.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT
from turbonode import logs


@pytest.fixture
def stream(tmp_path):
    with open(tmp_path / "stderr", "w+") as f:
        yield f


def journal_env(f) -> dict[str, str]:
    st = os.fstat(f.fileno())
    return {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}


@pytest.mark.parametrize(
    "levelno,priority",
    [
        (logging.CRITICAL, 2),
        (logging.ERROR, 3),
        (logging.WARNING, 4),
        (logging.INFO, 6),
        (logging.DEBUG, 7),
        (logging.NOTSET, 7),
        (25, 6),
        (35, 4),
        (45, 3),
        (60, 2),
    ],
)
def test_syslog_priority(levelno, priority):
    assert logs.syslog_priority(levelno) == priority


def test_journal_stream_is_matched_by_device_and_inode(stream, tmp_path):
    assert logs.stream_is_journal(stream, journal_env(stream))
    with open(tmp_path / "other", "w") as other:  # the variable inherited by a child writing elsewhere
        assert not logs.stream_is_journal(other, journal_env(stream))
    for value in ("", "garbage", "1:", ":2", "1:2:3", "-1:2"):
        assert not logs.stream_is_journal(stream, {"JOURNAL_STREAM": value}), value
    assert not logs.stream_is_journal(stream, {})
    assert not logs.stream_is_journal(io.StringIO(), journal_env(stream))  # no file behind it
    stream.close()
    assert not logs.stream_is_journal(stream, {"JOURNAL_STREAM": "1:2"})


def test_every_line_of_a_record_carries_its_priority():
    fmt = logs.JournalFormatter(logs.JOURNAL_FORMAT)
    rec = logging.LogRecord("turbonode.agent", logging.WARNING, __file__, 1, "two\nlines", None, None)
    assert fmt.format(rec) == "<4>turbonode.agent WARNING two\n<4>lines"
    try:
        raise ValueError("boom")
    except ValueError:
        rec = logging.LogRecord("render", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    lines = fmt.format(rec).split("\n")
    assert lines[0] == "<3>render ERROR failed" and len(lines) > 3
    assert all(line.startswith("<3>") for line in lines) and lines[-1] == "<3>ValueError: boom"
    assert logs.prefix_lines("a\n\nb", 6) == "<6>a\n<6>\n<6>b"


def test_setup_prefixes_only_on_the_journal_stream(stream, tmp_path):
    root = logging.getLogger()
    saved = root.level, list(root.handlers)
    try:
        assert logs.setup(logging.INFO, stream, journal_env(stream))
        logging.getLogger("turbonode.test").info("lifecycle event")
        logging.getLogger("turbonode.test").debug("not shown at INFO")
        with open(tmp_path / "terminal", "w+") as plain:
            assert not logs.setup(logging.INFO, plain, {})
            # the second call replaced the first handler: one of ours, writing to the new stream
            assert [h.name for h in root.handlers].count(logs.HANDLER_NAME) == 1
            logging.getLogger("turbonode.test").warning("careful")
            plain.flush()
            plain.seek(0)
            text = plain.read()
        stream.seek(0)
        assert stream.read() == "<6>turbonode.test INFO lifecycle event\n"
        assert text.endswith(" turbonode.test WARNING careful\n") and not text.startswith("<")
    finally:
        for h in [h for h in root.handlers if h.name == logs.HANDLER_NAME]:
            root.removeHandler(h)
        root.setLevel(saved[0])


def test_show_lifecycle_lasts_until_the_next_setup(stream):
    root = logging.getLogger()
    saved = root.level
    daemon = logging.getLogger("turbonode.test.daemon")
    try:
        logs.setup(logging.WARNING, stream, {})
        logs.show_lifecycle("turbonode.test.daemon")
        assert daemon.getEffectiveLevel() == logging.INFO and root.level == logging.WARNING
        logs.setup(logging.DEBUG, stream, {})  # -vv: lower than INFO stays lower
        logs.show_lifecycle("turbonode.test.daemon")
        assert daemon.getEffectiveLevel() == logging.DEBUG
        logs.setup(logging.WARNING, stream, {})  # the next command (CliRunner) starts clean
        assert daemon.level == logging.NOTSET and daemon.getEffectiveLevel() == logging.WARNING
    finally:
        for h in [h for h in root.handlers if h.name == logs.HANDLER_NAME]:
            root.removeHandler(h)
        root.setLevel(saved)


def test_uncaught_exceptions_and_warnings_reach_the_journal_with_a_priority(tmp_path):
    """A real process whose stderr is the 'journal' file: a Python warning at <4>, a crash at <2>."""
    script = textwrap.dedent("""
        import logging, os, sys, threading, warnings
        from turbonode import logs
        st = os.fstat(2)
        os.environ["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        assert logs.setup(logging.INFO)
        warnings.warn("deprecated knob")
        t = threading.Thread(target=lambda: 1 / 0, name="engine")
        t.start(); t.join()
        raise RuntimeError("crash")
    """)
    with open(tmp_path / "journal", "w+") as err:
        proc = subprocess.run(
            [sys.executable, "-c", script],
            stderr=err,
            cwd=ROOT,
            timeout=60,
        )
        err.seek(0)
        lines = err.read().splitlines()
    assert proc.returncode == 1
    assert all(line[:3] in ("<2>", "<3>", "<4>") for line in lines), lines
    assert any(line.startswith("<4>py.warnings WARNING") and "deprecated knob" in line for line in lines), lines
    assert "<3>turbonode ERROR uncaught exception in thread engine" in lines
    assert "<3>ZeroDivisionError: division by zero" in lines
    assert "<2>turbonode CRITICAL uncaught exception" in lines and lines[-1] == "<2>RuntimeError: crash"


def test_a_command_error_reaches_the_journal_at_err(tmp_path):
    """turboctl's "Error: ..." (a bad key, here) carries <3> when stderr is the journal, and
    stays plain on a terminal or a pipe."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[worker]\nmax_batch = 0\n")
    argv = [os.path.join(os.path.dirname(sys.executable), "turboctl"), "config", "check", str(bad)]
    with open(tmp_path / "journal", "w+") as err:
        st = os.fstat(err.fileno())
        env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert subprocess.run(argv, stderr=err, env=env, timeout=60).returncode == 1
        err.seek(0)
        assert err.read() == "<3>Error: invalid configuration: worker.max_batch: must be between 1 and 1024, got 0\n"
    plain = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert plain.returncode == 1 and plain.stderr.startswith("Error: invalid configuration: worker.max_batch")
