import os
import socket
import time

from turbonode.sdnotify import notify, watchdog_interval


def test_notify_sends_datagram(tmp_path):
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind(path)
        assert notify("READY=1", env={"NOTIFY_SOCKET": path})
        assert srv.recv(100) == b"READY=1"
    assert notify("READY=1", env={}) is False


def test_watchdog_interval():
    assert watchdog_interval({"WATCHDOG_USEC": "4000000"}) == 2.0
    assert watchdog_interval({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}) is None or os.getpid() == 1
    assert watchdog_interval({}) is None


def test_notify_never_blocks_on_a_full_listener(tmp_path):
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind(path)
        start = time.monotonic()
        sent = [notify("WATCHDOG=1", env={"NOTIFY_SOCKET": path}) for _ in range(200)]
        assert time.monotonic() - start < 5
        assert sent[0] and not sent[-1]  # the queue filled up: later pings are dropped, not waited on
