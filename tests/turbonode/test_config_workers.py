"""A node's workers in the configuration ([workers.<name>]): what each resolves to, the single
`default` worker of a file that names none, and every bad entry named by its key."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from turboctl import main
from turbonode.config import DEFAULT_WORKER, Config, instance_worker, load_config, node_workers
from turbonode.config_example import render_example
from turbonode.errors import ConfigError

TWO = """
[worker]
listen = "10.0.0.5:9000"
control_socket = "/run/tn/worker.sock"
device = "cpu"
model = "tiny"
[workers.gpu0]
gpu = 0
cpus = "0-3"
[workers.gpu1]
gpu = 1
cpus = "4-7"
cgroup = "turbonode.slice"
[workers.cpu-side]
listen = "127.0.0.1:9100"
control_socket = "/run/tn/side.sock"
"""


def load(tmp_path, text: str, env: dict | None = None) -> Config:
    path = tmp_path / "t.toml"
    path.write_text(text)
    return load_config(str(path), env=env or {})


def test_a_file_naming_no_workers_has_one_default_worker(tmp_path):
    cfg = load(tmp_path, '[agent]\nworker_socket = "/run/x/w.sock"\n[levers]\nworker_cgroup = "/w"\n')
    (spec,) = node_workers(cfg)
    assert (spec.name, spec.control_socket, spec.listen, spec.gpus, spec.cgroup) == (
        DEFAULT_WORKER,
        "/run/x/w.sock",
        "0.0.0.0:8460",
        None,  # every GPU, as before workers had names
        "/w",
    )
    worker, _ = instance_worker(cfg, None)
    assert worker is cfg.worker and instance_worker(cfg, DEFAULT_WORKER)[0] is cfg.worker
    with pytest.raises(ConfigError, match=r"workers\.gpu0: no such worker \(this node's: default\)"):
        instance_worker(cfg, "gpu0")


def test_each_worker_resolves_its_socket_port_device_and_cpus(tmp_path):
    cfg = load(tmp_path, TWO)
    specs = {s.name: s for s in node_workers(cfg)}
    assert list(specs) == ["gpu0", "gpu1", "cpu-side"]  # the file's order
    g0, g1, side = specs.values()
    assert (g0.control_socket, g0.listen, g0.gpus, g0.device) == (
        "/run/tn/worker-gpu0.sock",
        "10.0.0.5:9000",
        (0,),
        "cuda:0",
    )
    assert (g1.control_socket, g1.listen, g1.device, g1.cgroup) == (
        "/run/tn/worker-gpu1.sock",
        "10.0.0.5:9001",  # worker.listen's port plus its position
        "cuda:1",
        "turbonode.slice",
    )
    assert g0.cpus == frozenset(range(4)) and g1.cpus == frozenset(range(4, 8)) and side.cpus == frozenset()
    assert (side.control_socket, side.listen, side.gpus, side.device) == (
        "/run/tn/side.sock",
        "127.0.0.1:9100",
        (),
        "cpu",
    )
    worker, spec = instance_worker(cfg, "gpu1")
    assert (worker.control_socket, worker.listen, worker.device, worker.model) == (
        "/run/tn/worker-gpu1.sock",
        "10.0.0.5:9001",
        "cuda:1",
        "tiny",  # the rest of [worker] is every worker's
    )
    with pytest.raises(ConfigError, match=r"names its workers \(gpu0, gpu1, cpu-side\): name one"):
        instance_worker(cfg, None)


@pytest.mark.parametrize(
    ("text", "key", "says"),
    [
        ('[workers."gpu 0"]\n', "workers.gpu 0", "a name is 1-32 letters"),
        ("[workers.gpu0]\ngpux = 1\n", "workers.gpu0.gpux", "unknown key"),
        ('[workers.gpu0]\nlisten = "nowhere"\n', "workers.gpu0.listen", "HOST:PORT"),
        ("[workers.gpu0]\ngpu = -2\n", "workers.gpu0.gpu", "between -1 and 1023"),
        ('[workers.gpu0]\ngpu = "0"\n', "workers.gpu0.gpu", "expected integer"),
        ('[workers.gpu0]\ndevice = "tpu"\n', "workers.gpu0.device", "auto, cpu, cuda or cuda:N"),
        ('[workers.gpu0]\ncpus = "3-1"\n', "workers.gpu0.cpus", "ascending"),
        ('[workers.gpu0]\ncpus = "all"\n', "workers.gpu0.cpus", "a CPU list"),
        ("workers = 3\n", "workers", "a table of tables"),
        ("[workers]\ngpu0 = 1\n", "workers.gpu0", "expected a table"),
        (
            '[workers.a]\ncontrol_socket = "/run/tn/w.sock"\n[workers.b]\ncontrol_socket = "/run/tn/w.sock"\n',
            "workers.b.control_socket",
            "is workers.a's too",
        ),
        ('[workers.a]\n[workers.b]\nlisten = "127.0.0.1:8460"\n', "workers.b.listen", "is workers.a's too"),
        ('[workers.a]\ncpus = "0-2"\n[workers.b]\ncpus = "2,3"\n', "workers.b.cpus", "CPUs 2 are workers.a's"),
        ('[worker]\nlisten = ":65535"\n[workers.a]\n[workers.b]\n', "workers.b.listen", "out of range"),
        ('[agent]\nworker_socket = "/run/w.sock"\n[workers.a]\n', "agent.worker_socket", "each [workers.<name>]"),
        ('[levers]\nworker_cgroup = "/w"\n[workers.a]\n', "levers.worker_cgroup", "each [workers.<name>]"),
    ],
)
def test_a_bad_worker_entry_is_named_by_its_key(tmp_path, text, key, says):
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    assert info.value.key == key and says in str(info.value), str(info.value)


def test_workers_are_not_set_from_the_environment(tmp_path):
    with pytest.raises(ConfigError, match="tables are set in the configuration file"):
        load(tmp_path, "", env={"TURBONODE_WORKERS_GPU0_GPU": "1"})


def test_config_check_and_workers_commands(tmp_path):
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text(TWO)
    bad.write_text('[workers.a]\ncpus = "0"\n[workers.b]\ncpus = "0"\n')
    res = CliRunner().invoke(main, ["config", "check", str(bad)])
    assert res.exit_code == 1 and "workers.b.cpus: CPUs 0 are workers.a's too" in res.output
    res = CliRunner().invoke(main, ["config", "workers", "--units", str(good)])
    assert res.output.split() == [f"turbonode-worker@{n}.service" for n in ("gpu0", "gpu1", "cpu-side")]
    res = CliRunner().invoke(main, ["config", "workers", str(tmp_path / "none.toml")])
    assert res.exit_code == 1 and "file not found" in res.output


def test_worker_run_names_an_instance_the_file_lacks_before_loading_anything(tmp_path):
    cfg = tmp_path / "t.toml"
    cfg.write_text(TWO)
    res = CliRunner().invoke(main, ["worker", "run", "--config", str(cfg), "--instance", "gpu9"])
    assert res.exit_code == 1 and "workers.gpu9: no such worker (this node's: gpu0, gpu1, cpu-side)" in res.output
    res = CliRunner().invoke(main, ["worker", "run", "--config", str(cfg)])
    assert res.exit_code == 1 and "--instance NAME picks one" in res.output


def test_the_example_shows_a_worker_table_and_loads(tmp_path):
    text = render_example()
    assert "# [workers.gpu0]" in text and "# cpus = " in text
    assert load(tmp_path, text) == Config()
    uncommented = text.replace("# [workers.gpu0]", "[workers.gpu0]")
    for key in ("control_socket", "listen", "gpu", "device", "cgroup", "cpus"):
        uncommented = uncommented.replace(f"\n# {key} = ", f"\n{key} = ")
    assert [s.name for s in node_workers(load(tmp_path, uncommented))] == ["gpu0"]
