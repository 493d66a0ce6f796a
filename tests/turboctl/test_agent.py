"""`turboctl status` rendering (CliRunner against a real status socket) and `agent run` options."""

import json
import socket

import pytest
from click.testing import CliRunner

from turboctl import main
from turbonode.errors import TurbonodeError
from turbonode.rpc_server import UnixRpcServer

SNAPSHOT = {
    "level": "degraded",
    "level_index": 2,
    "active": [{"signal": "netrx_cpu_share", "value": 0.41, "threshold": 0.25, "crossed": "above enter"}],
    "last_change": {
        "at": 1000.0,
        "from": "pressured",
        "to": "degraded",
        "reasons": [{"signal": "netrx_cpu_share", "value": 0.41, "threshold": 0.25, "crossed": "above enter"}],
    },
    "signals": {"netrx_cpu_share": 0.41},
    "watchers": {
        "softirq": {"ok": True, "error": None, "mode": "procfs", "bpf_error": "tracepoints missing"},
        "gpu": {"ok": False, "error": "NVML unavailable: no driver"},
    },
    "actions": {
        "applied": {"relax_ceil_pct": 25},
        "dry_run": False,
        "levers": {
            "cpu_share": {"engaged": True, "reason": "netrx_cpu_share=0.41 > 0.25", "error": None},
            "changed": {},
            "restore_problems": [],
        },
    },
    "qos": {
        "turbo": {
            "packets": 120,
            "bytes": 90000,
            "drops": 0,
            "backlog_bytes": 0,
            "rate_bps": 40_000_000,
            "ceil_bps": 100_000_000,
        },
        "relax": {
            "packets": 5,
            "bytes": 700,
            "drops": 3,
            "backlog_bytes": 1500,
            "rate_bps": 10_000_000,
            "ceil_bps": 25_000_000,
            "limit": {"class": "1:41", "ceil_bps": 25_000_000, "in_force": True, "until": 1002.5},
        },
    },
    "workers": {
        "default": {
            "state": "ok",
            "tiers": {"turbo": {"queued": 1, "in_flight": 2, "oldest_wait_s": 0.012, "queue_wait_p99_s": 0.03}},
            "throttle": {"max_batch": 2, "paused_tiers": ["relax"], "step_caps": {}, "expires_in_s": 2.1},
            "level": "degraded",
            "active": [{"signal": "netrx_cpu_share", "value": 0.41, "threshold": 0.25, "crossed": "above enter"}],
            "sent": {"max_batch": 2, "paused_tiers": ["relax"]},
            "hold": None,
            "levers": {"worker_threads": {"engaged": False, "reason": "", "error": None}},
        }
    },
}


def test_status_table_shows_level_why_qos_worker(tmp_path):
    path = str(tmp_path / "agent.sock")
    srv = UnixRpcServer(path, {"status": lambda: SNAPSHOT}).start()
    args = ["status", "--socket", path, "--worker-socket", str(tmp_path / "no-worker.sock")]
    try:
        out = CliRunner().invoke(main, args)
        js = CliRunner().invoke(main, [*args, "--json"])
    finally:
        srv.close()
    assert out.exit_code == 1, out.output  # the worker's own socket does not answer: shown, and exit 1
    assert "worker default: unreachable" in out.output and "the agent sees it ok" in out.output
    text = out.output
    assert "level:    degraded" in text
    assert "pressured -> degraded" in text and "netrx_cpu_share=0.41 > 0.25" in text
    assert "relax ceil 25 %" in text
    assert "levers:   cpu_share engaged (netrx_cpu_share=0.41 > 0.25)" in text
    assert "agent:    level degraded: netrx_cpu_share=0.41 > 0.25; throttle sent {'max_batch': 2" in text
    assert "levers:   worker_threads off" in text
    assert "gpu: NVML unavailable: no driver" in text
    assert "/proc/softirqs fallback" in text
    relax = next(line for line in text.splitlines() if line.startswith("relax"))
    assert relax.split() == ["relax", "5", "700", "3", "1500", "10mbit", "25mbit"]
    assert ["turbo", "1", "2", "12.0", "ms", "30.0", "ms"] in [line.split() for line in text.splitlines()]
    assert "throttle: max_batch=2, paused_tiers=['relax'], expires_in_s=2.1" in text
    assert "limit:    relax ceil 25mbit in force until " in text and "unless the agent renews it; class 1:41" in text
    assert json.loads(js.output)["agent"]["level"] == "degraded"


def test_status_socket_is_not_stolen_from_a_live_agent(tmp_path):
    path = str(tmp_path / "agent.sock")
    srv = UnixRpcServer(path, {"status": lambda: SNAPSHOT}).start()
    try:
        with pytest.raises(TurbonodeError, match="already serving"):
            UnixRpcServer(path, {})
    finally:
        srv.close()
    stale = str(tmp_path / "stale.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:  # what a killed agent leaves
        dead.bind(stale)
    UnixRpcServer(stale, {}).close()
    (tmp_path / "file.sock").write_bytes(b"")  # not a socket at all: never unlinked
    with pytest.raises(TurbonodeError, match="not a socket"):
        UnixRpcServer(str(tmp_path / "file.sock"), {})


def test_agent_run_help_lists_the_options():
    out = CliRunner().invoke(main, ["agent", "run", "--help"])
    for opt in ("--config", "--dev", "--netns", "--worker-socket", "--metrics", "--dry-run"):
        assert opt in out.output
