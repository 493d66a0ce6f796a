"""What `config check` accepts, the daemons can run (issue 10, section 5): every value either
runs or is refused with one line naming the key and the allowed range; no traceback, no hang."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from render.throttle import make_throttle
from tc.tree import build_tree
from tests.helpers import ROOT, needs_bcc
from turboctl import main
from turbonode import config
from turbonode.config import load_config
from turbonode.errors import ConfigError, TurbonodeError
from turbonode.qos_params import MAX_LEAF_LIMIT, MAX_LINK_RATE_BPS, MIN_CLASS_RATE_BPS, MIN_LINK_RATE_BPS
from turbonode.rates import format_rate
from turbonode.rpc_server import UnixRpcServer
from turbonode.throttle_params import MAX_THROTTLE_TTL_S


def refused(tmp_path: Path, text: str | bytes, env: dict[str, str] | None = None) -> ConfigError:
    path = tmp_path / "t.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path), env=env or {})
    return info.value


@pytest.mark.parametrize(
    "text,key,says",
    [
        # what the daemons could not run
        ("[agent]\nthrottle_ttl = 7200\n", "agent.throttle_ttl", "3600"),
        ("[agent]\nsample_period = 0.25\nthrottle_ttl = 0.3\n", "agent.throttle_ttl", "twice agent.sample_period"),
        ("[agent]\nsample_period = nan\n", "agent.sample_period", "between 0.05 and 60 s, got nan"),
        ("[agent]\nsample_period = inf\n", "agent.sample_period", "between 0.05 and 60 s, got inf"),
        ("[agent]\nsample_period = 1e300\n", "agent.sample_period", "0.05 and 60"),
        ("[agent]\nsample_period = 0.0001\n", "agent.sample_period", "0.05 and 60"),
        ("[worker]\ndrain_timeout = nan\n", "worker.drain_timeout", "more than 0 and at most 3600 s, got nan"),
        ("[worker]\ndrain_timeout = 1e12\n", "worker.drain_timeout", "3600"),
        ("[worker]\nfront_nice = -2\n", "worker.front_nice", "-1"),
        ("[worker]\nmin_share = nan\n", "worker.min_share", "between 0 and 1, got nan"),
        ("[worker]\nguidance = { fast = -inf }\n", "worker.guidance", "fast: must be a number between 0 and 50"),
        ("[policy]\nmin_change_interval = inf\n", "policy.min_change_interval", "at most 3600 s, got inf"),
        ("[policy.rules.turbo_wait_s]\nenter = inf\n", "policy.rules", "turbo_wait_s.enter: must be a finite"),
        ("[policy.rules.gc_pause_s]\nenter = nan\n", "policy.rules", "gc_pause_s.enter: must be a finite number"),
        ("[policy]\npsi_trigger_us = 2000000\n", "policy.psi_trigger_us", "1000000"),
        ("[qos.rate_pct]\nfast = 45\n", "qos.rate_pct", "add up to 140 %"),
        ("[qos.ceil_pct]\nrelax = 1\n", "qos.ceil_pct", "relax: 1 % is below its rate_pct (2 %)"),
        ("[qos.ceil_pct]\nrelax = 500\n", "qos.ceil_pct", "relax: must be a percent 1..100"),
        ("[qos.rate_pct]\nrelax = 0\n", "qos.rate_pct", "relax: must be a percent 1..100"),
        ("[qos]\nleaf_limit = 4294967296\n", "qos.leaf_limit", f"1 and {MAX_LEAF_LIMIT}"),
        ('[qos]\nrate = "1bit"\n', "qos.rate", "64kbit"),
        ('[qos]\nrate = "99999999999tbit"\n', "qos.rate", "10tbit"),
        ('[qos]\nrate = "' + "9" * 400 + 'bit"\n', "qos.rate", "expected a number and a unit"),
        ("[worker]\nsize = 100\n", "worker.size", "multiple of 8"),
        ('[worker]\ndevice = "tpu"\n', "worker.device", "must be auto, cpu, cuda or cuda:N, got 'tpu'"),
        ('[worker]\ndevice = "cuda:x"\n', "worker.device", "cuda:N"),
        ("[worker]\nmax_batch = 18446744073709551616\n", "worker.max_batch", "between 1 and 1024"),
        ("[worker]\nsize = 4096\n", "worker.size", "64 and 2048"),
        ("[worker.steps]\nturbo = 500\n", "worker.steps", "turbo: must be between 1 and 200"),
        # wrong types inside tables: a line, never a traceback
        ('[qos.rate_pct]\nturbo = "x"\n', "qos.rate_pct", "turbo: expected integer, got 'x'"),
        ('[worker.steps]\nturbo = "four"\n', "worker.steps", "turbo: expected integer, got 'four'"),
        ("[worker.queue_limit]\nrelax = 2.5\n", "worker.queue_limit", "relax: expected integer"),
        ("[worker.sampler]\nturbo = 3\n", "worker.sampler", "turbo: expected string"),
        ('[policy]\ndisabled = ["cpu_load", 3]\n', "policy.disabled", "[1]: expected string"),
        ("[qos]\ndscp = { '²' = 'turbo' }\n", "qos.dscp", "integer 0..63"),
        ('[worker]\nlisten = "0.0.0.0:²"\n', "worker.listen", "HOST:PORT"),
        ("[policy.actions.critical]\nrelax_ceil_pct = true\n", "policy.actions", "critical.relax_ceil_pct"),
        ("[qos]\nrate = " + "[" * 50 + "]" * 50 + "\n", "qos.rate", "expected string"),
    ],
)
def test_values_the_daemons_cannot_run_are_refused_naming_key_and_range(tmp_path, text, key, says):
    err = refused(tmp_path, text)
    assert err.key == key, str(err)
    assert str(err).startswith(key + ": ") and says in str(err), str(err)
    assert "\n" not in str(err) and len(str(err)) < 300


@pytest.mark.parametrize(
    "content,says",
    [
        (b"\xff\xfe\x00binary\x00", "not UTF-8 text"),
        ("[agent]\nprocfs = '/pr\u00f6c'\n".encode("latin-1"), "not UTF-8 text"),
        (("a = " + "[" * 5000 + "]" * 5000 + "\n").encode(), "nested too deeply"),
        (("a = " + "{b = " * 3000 + "1" + "}" * 3000 + "\n").encode(), "nested too deeply"),
        (b"# " + b"x" * (2 << 20) + b"\n", "larger than 1 MiB"),
    ],
    ids=["binary", "latin-1", "arrays-5000", "tables-3000", "2-MiB"],
)
def test_unreadable_files_are_one_line_naming_the_file(tmp_path, content, says):
    err = refused(tmp_path, content)
    assert err.key.endswith("t.toml") and says in str(err) and "\n" not in str(err)


def test_limits_are_the_ones_the_daemons_enforce(tmp_path):
    """One definition each: the worker takes the longest throttle the agent may ask for, the tree
    builder what config check passes, and refuses what it refuses."""
    make_throttle(reason="x", ttl_s=MAX_THROTTLE_TTL_S, now=0, now_wall=0)
    with pytest.raises(ValueError, match="ttl_s"):
        make_throttle(reason="x", ttl_s=MAX_THROTTLE_TTL_S + 1, now=0, now_wall=0)
    path = tmp_path / "ok.toml"
    path.write_text(
        f"[agent]\nthrottle_ttl = {MAX_THROTTLE_TTL_S}\n"
        f'[qos]\nrate = "1mbit"\nleaf_limit = {MAX_LEAF_LIMIT}\n'
        "rate_pct = { turbo = 91, fast = 4, other = 3, relax = 2 }\nceil_pct = { relax = 2 }\n"
    )
    cfg = load_config(str(path), env={})
    build_tree(
        1_000_000, rate_pct=cfg.qos.rate_pct, ceil_pct=cfg.qos.ceil_pct, leaf_limit=cfg.qos.leaf_limit
    )  # accepted by both
    for bad in ({"rate_pct": {"fast": 45}}, {"ceil_pct": {"relax": 500}}, {"leaf_limit": MAX_LEAF_LIMIT + 1}):
        with pytest.raises(ValueError):
            build_tree(1_000_000, **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="64kbit"):
        build_tree(8)


@needs_bcc
def test_the_edges_config_check_accepts_are_applied_by_the_kernel(sandbox, tmp_path):
    """The smallest and largest link, the smallest shares and the longest leaf queues: they run,
    and so does changing the link rate of an applied tree (an operator editing qos.rate)."""
    target = ["--dev", sandbox.dev, "--netns", sandbox.server]
    cfg = tmp_path / "edges.toml"
    try:
        for rate in (MIN_LINK_RATE_BPS, MAX_LINK_RATE_BPS, 100 * 10**6):
            cfg.write_text(
                f'[qos]\nrate = "{format_rate(rate)}"\nleaf_limit = {MAX_LEAF_LIMIT}\n'
                "rate_pct = { turbo = 97, fast = 1, other = 1, relax = 1 }\n"
                "ceil_pct = { fast = 1, other = 1, relax = 1 }\n"
            )
            load_config(str(cfg), env={})
            res = CliRunner().invoke(main, ["qos", "apply", *target, "--config", str(cfg)])
            assert res.exit_code == 0, res.output
        res = CliRunner().invoke(main, ["qos", "set-rate", *target, "relax", format_rate(MIN_CLASS_RATE_BPS)])
        assert res.exit_code == 0, res.output
    finally:
        CliRunner().invoke(main, ["qos", "remove", *target])


def test_a_fifo_as_the_config_path_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    proc = subprocess.run(
        [sys.executable, "-m", "turboctl", "config", "check", str(fifo)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 1 and "not a regular file" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    (tmp_path / "dir.toml").mkdir()  # a directory too
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(str(tmp_path / "dir.toml"), env={})
    (tmp_path / "null.toml").symlink_to(os.devnull)  # but /dev/null is "no file", as usual
    assert load_config(str(tmp_path / "null.toml"), env={}) == load_config(os.devnull, env={})


def test_config_check_without_a_file_says_it_does_not_exist(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "DEFAULT_PATH", str(tmp_path / "absent.toml"))
    res = CliRunner().invoke(main, ["config", "check"], env={})
    assert res.exit_code == 0, res.output
    assert "absent.toml: OK" not in res.output
    assert "absent.toml does not exist" in res.output and "defaults" in res.output
    present = tmp_path / "absent.toml"
    present.write_text("[worker]\nmax_batch = 2\n")
    res = CliRunner().invoke(main, ["config", "check"], env={})
    assert res.exit_code == 0 and "absent.toml: OK" in res.output


def test_cli_environment_variables_are_not_config_keys(tmp_path, monkeypatch):
    env = {"TURBONODE_WORKER_URL": "http://127.0.0.1:1", "TURBONODE_WORKER_SOCKET": str(tmp_path / "w.sock")}
    load_config(None, env=env)  # the CLI's own options: not configuration keys
    monkeypatch.setattr(config, "DEFAULT_PATH", str(tmp_path / "absent.toml"))
    res = CliRunner().invoke(main, ["config", "check"], env=env)
    assert res.exit_code == 0, res.output
    # a name in the config's namespace that is no key is still refused, naming the variable
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"TURBONODE_WORKER_MAXBATCH": "3"})
    assert info.value.key == "TURBONODE_WORKER_MAXBATCH" and "worker.maxbatch" in str(info.value)


@pytest.mark.parametrize(
    "argv,says",
    [
        (["qos", "apply", "--dev", "lo", "--rate", "1bit"], "between 64kbit and 10tbit"),
        (["qos", "apply", "--dev", "lo", "--rate", "9" * 400 + "bit"], "expected a number and a unit"),
        (["qos", "set-rate", "--dev", "lo", "relax", "80bit"], "between 640bit and 10tbit"),
        (["throttle", "--reason", "x", "--step-cap", "relax=²"], "TIER=STEPS"),
        (["qos", "set-map", "--dev", "lo", "²=turbo"], "DSCP=TIER"),
    ],
)
def test_cli_values_are_refused_before_anything_runs(argv, says):
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 2 and says in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


def run_worker(tmp_path: Path, toml: str) -> subprocess.CompletedProcess:
    cfg = tmp_path / "worker.toml"
    cfg.write_text(f'[worker]\nmodel = "tiny"\ndevice = "cpu"\nlisten = "127.0.0.1:0"\n{toml}')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TURBONODE_", "NOTIFY_", "WATCHDOG_"))}
    return subprocess.run(
        [sys.executable, "-m", "turboctl", "worker", "run", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
    )


def test_the_worker_refuses_a_size_its_model_cannot_render(tmp_path):
    # 72 passes config check (a multiple of 8); the tiny model's UNet needs multiples of 16
    proc = run_worker(tmp_path, f'size = 72\ncontrol_socket = "{tmp_path}/w.sock"\n')
    assert proc.returncode == 1, proc.stderr
    assert "worker.size: 72 is not a multiple of 16" in proc.stderr and "Traceback" not in proc.stderr


def test_a_control_socket_directory_that_cannot_be_created_is_named(tmp_path):
    """Issue 10, section 6: not "cannot listen on 127.0.0.1:PORT", but the path and the reason."""
    (tmp_path / "afile").write_text("a regular file where a directory should be")
    sock = tmp_path / "afile" / "run" / "worker.sock"
    with pytest.raises(TurbonodeError) as info:  # the transport both daemons' sockets use
        UnixRpcServer(str(sock), {}, owner="agent")
    assert f"{tmp_path / 'afile' / 'run'}" in str(info.value) and "Not a directory" in str(info.value)
    proc = run_worker(tmp_path, f'control_socket = "{sock}"\n')
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "cannot listen on 127.0.0.1" not in last and str(tmp_path / "afile" / "run") in last, proc.stderr
    assert "Not a directory" in last and "Traceback" not in proc.stderr
