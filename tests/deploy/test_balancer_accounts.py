"""The shipped HAProxy configuration's accounts part (deploy/haproxy/turbonode.cfg), on loopback in
front of a real worker with keys: the balancer checks the key against `turboctl keys list
--haproxy-map` and names its account; what a client puts in the account or tier header never
reaches the worker; and the worker obeys those headers from the balancer's address alone."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from sandbox.fleet import wait_state
from tests.deploy.helpers import haproxy_config
from tests.helpers import call, daemon_env, free_port, readyz, start, stop, turboctl_argv
from turboctl import main
from turbonode.accounts import entry, hash_key
from turbonode.tier_headers import ACCOUNT_HEADER, TIER_HEADER
from turbonode.tiers import TIER_NAMES

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy not installed (scripts/setup.sh)"),
]
ALICE = "tn-balanced-key-of-alice"


@pytest.fixture
def balanced():
    """A worker trusting 127.0.0.1 (HAProxy's source address here), HAProxy on another port."""
    work = Path(tempfile.mkdtemp(prefix="tn-lb-keys-"))
    procs = []
    try:
        keys = work / "keys.toml"
        keys.write_text(entry("alice", hash_key(ALICE), list(TIER_NAMES), {}, None))
        port, lb = free_port(), free_port()
        cfg = work / "w.toml"
        cfg.write_text(
            f'[worker]\nlisten = "127.0.0.1:{port}"\ncontrol_socket = "{work}/w.sock"\nmodel = "tiny"\n'
            f'device = "cpu"\nsize = 64\nkeys_file = "{keys}"\nledger_file = "{work}/ledger.sqlite3"\n'
            'trusted_proxies = ["127.0.0.1"]\n'
        )
        procs.append(start(turboctl_argv("worker", "run", "--config", str(cfg)), daemon_env()))
        mapped = CliRunner().invoke(main, ["keys", "list", "--file", str(keys), "--config", str(cfg), "--haproxy-map"])
        assert mapped.exit_code == 0, mapped.output
        (work / "turbonode-keys.map").write_text(mapped.output)
        stats = work / "haproxy.sock"
        names = ("w1", "w2", "w3", "w4")  # the shipped file's four servers, all this one worker
        text = haproxy_config([(n, "127.0.0.1", port) for n in names], stats)
        text = text.replace("bind :8460", f"bind 127.0.0.1:{lb}")
        # the key check, as its comment says to turn it on: the map written, the lines uncommented
        checks = re.findall(r"^\s*#(http-request set-.*txn\.account.*)$", text, re.M)
        assert len(checks) == 2, checks
        for line in checks:
            text = text.replace(f"#{line}", line)
        text = text.replace("/etc/haproxy/turbonode-keys.map", str(work / "turbonode-keys.map"))
        (work / "haproxy.cfg").write_text(text)
        check = subprocess.run(["haproxy", "-c", "-f", str(work / "haproxy.cfg")], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        procs.append(start(["haproxy", "-db", "-f", str(work / "haproxy.cfg")], daemon_env()))
        deadline = time.monotonic() + 180
        while True:
            try:
                if readyz(f"http://127.0.0.1:{port}")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, procs[0][1].text
            time.sleep(0.1)
        up = {(b, n): "UP" for b in ("turbo", "workers") for n in names}
        assert wait_state(stats, up, 20) == up
        yield f"http://127.0.0.1:{lb}", f"http://127.0.0.1:{port}"
    finally:
        for proc, _ in reversed(procs):
            stop(proc)
        shutil.rmtree(work, ignore_errors=True)


def test_the_balancer_names_the_account_and_strips_what_clients_claim(balanced):
    lb, worker = balanced
    body = {"prompt": "x", "size": "64x64", "steps": 1, "tier": "turbo"}
    status, headers, answer = call(lb, body=body, key=ALICE)
    assert status == 200 and answer["turbonode"]["account"] == "alice" and headers[TIER_HEADER] == "turbo"
    # a forged account header with no key: HAProxy drops it, and the worker wants a key
    assert call(lb, body=body, headers={ACCOUNT_HEADER: "alice"})[0] == 401
    assert call(lb, body=body, key="tn-not-alice")[0] == 401
    # a forged tier header: dropped too; the key's own request, without a tier in its body, is `other`
    status, headers, _ = call(lb, body={**body, "tier": None}, key=ALICE, headers={TIER_HEADER: "turbo"})
    assert status == 200 and headers[TIER_HEADER] == "other"
    # straight to the worker from an address that is not the balancer: the account header is ignored
    assert call(worker, body=body, headers={ACCOUNT_HEADER: "alice"}, source="127.0.0.2")[0] == 401
