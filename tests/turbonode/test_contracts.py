"""The shared contracts: tiers, rates, config, JSON-RPC framing."""

from __future__ import annotations

import io
import json
import re

import pytest

from tests.helpers import ROOT
from turbonode import jsonrpc
from turbonode.config import load_config
from turbonode.errors import ConfigError, RateError
from turbonode.rates import format_rate, parse_rate
from turbonode.throttle_params import THROTTLE_KEYS
from turbonode.tiers import BY_NAME, PRIORITY_ORDER, full_dscp_map, tos_byte


def test_tier_table_matches_design():
    assert PRIORITY_ORDER == ("turbo", "fast", "other", "relax")
    assert [BY_NAME[t].class_minor for t in PRIORITY_ORDER] == [0x10, 0x20, 0x30, 0x40]
    assert sum(BY_NAME[t].rate_pct for t in PRIORITY_ORDER) == 100
    table = full_dscp_map()
    assert table[46] == BY_NAME["turbo"].index
    assert [table[d] for d in (34, 36, 38)] == [BY_NAME["fast"].index] * 3
    assert table[8] == table[1] == BY_NAME["relax"].index
    assert table[0] == table[63] == BY_NAME["other"].index
    assert full_dscp_map({0: "relax"})[0] == BY_NAME["relax"].index
    assert tos_byte("turbo") == 0xB8


@pytest.mark.parametrize(
    "text,bits",
    [
        ("100mbit", 100_000_000),
        ("1gbit", 10**9),
        ("1.5mbit", 1_500_000),
        ("10mbps", 80_000_000),
        ("800", 800),
        (" 2 Gbit ", 2 * 10**9),
    ],
)
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("bad", ["fast", "10 furlongs", "-1mbit", "0mbit", ""])
def test_parse_rate_rejects(bad):
    with pytest.raises(RateError):
        parse_rate(bad)


def test_format_rate_round_trip():
    for text in ("100mbit", "1gbit", "250kbit", "1234bit"):
        assert format_rate(parse_rate(text)) == text


def test_config_defaults_env_and_flags(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('[agent]\nsample_period = 1\n[qos]\nrate = "100mbit"\n')
    cfg = load_config(str(path), env={"TURBONODE_QOS_RATE": "200mbit"}, overrides={"agent.dry_run": True})
    assert cfg.agent.sample_period == 1.0 and isinstance(cfg.agent.sample_period, float)
    assert cfg.qos.rate == "200mbit"  # environment beats the file
    assert cfg.agent.dry_run is True  # flags beat everything
    assert cfg.worker.queue_limit["turbo"] == 32 and cfg.worker.steps == {}  # untouched defaults (steps: the family's)


@pytest.mark.parametrize(
    "text,key",
    [
        ("[agent]\nsampl_period = 1\n", "agent.sampl_period"),
        ("[worker]\nmax_batch = 0\n", "worker.max_batch"),
        ("[worker]\nsteps = { turbo = -1 }\n", "worker.steps"),
        ("[worker]\nqueue_limit = { ultra = 3 }\n", "worker.queue_limit"),
        ('[worker]\nsampler = { turbo = "heun9" }\n', "worker.sampler"),
        ("[worker]\nguidance = { relax = 99 }\n", "worker.guidance"),
        ("[worker]\ndrain_timeout = 0\n", "worker.drain_timeout"),
        ('[qos]\nrate = "fast"\n', "qos.rate"),
        ("[qos]\ndscp = { 64 = 'turbo' }\n", "qos.dscp"),
        ("[agent]\ndry_run = 'yes'\n", "agent.dry_run"),
        ("nonsense = 1\n", "nonsense"),
        # the weight port (render/front/weight_agent.py): in range, an int, not an HTTP port, one per worker
        ("[worker]\nweight_port = 70000\n", "worker.weight_port"),
        ('[worker]\nweight_port = "8560"\n', "worker.weight_port"),
        ('[worker]\nlisten = "0.0.0.0:65500"\n', "worker.weight_port"),  # derived: 65600
        ("[worker]\nweight_port = 8460\n", "worker.weight_port"),  # the HTTP port
        ("[workers.a]\n[workers.b]\nweight_port = 8460\n", "workers.b.weight_port"),  # a's HTTP port
        ("[workers.a]\nweight_port = 9000\n[workers.b]\nweight_port = 9000\n", "workers.b.weight_port"),
        ('[worker]\nlisten = "0.0.0.0:8460"\nweight_port = 8461\n[workers.a]\n[workers.b]\n', "worker.weight_port"),
    ],
)
def test_config_names_the_bad_key(tmp_path, text, key):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path), env={})
    assert info.value.key == key and str(info.value).startswith(key + ":")


def test_config_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(str(tmp_path / "nope.toml"), env={})


def _call(handlers, obj):
    line = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return jsonrpc.dispatch(handlers, line)


def test_jsonrpc_dispatch_and_standard_errors():
    handlers = {"add": lambda a, b: a + b, "boom": lambda: 1 / 0}
    ok = _call(handlers, {"jsonrpc": "2.0", "id": 1, "method": "add", "params": {"a": 1, "b": 2}})
    assert ok == {"jsonrpc": "2.0", "id": 1, "result": 3}
    assert _call(handlers, b"{not json")["error"]["code"] == jsonrpc.PARSE_ERROR
    assert _call(handlers, [1, 2])["error"]["code"] == jsonrpc.INVALID_REQUEST
    assert _call(handlers, {"jsonrpc": "1.0", "id": 2, "method": "add"})["error"]["code"] == jsonrpc.INVALID_REQUEST
    assert _call(handlers, {"jsonrpc": "2.0", "id": 3, "method": "nope"})["error"]["code"] == jsonrpc.METHOD_NOT_FOUND
    bad = _call(handlers, {"jsonrpc": "2.0", "id": 4, "method": "add", "params": {"a": 1}})
    assert bad["error"]["code"] == jsonrpc.INVALID_PARAMS
    assert _call(handlers, {"jsonrpc": "2.0", "id": 5, "method": "boom"})["error"]["code"] == jsonrpc.INTERNAL_ERROR
    assert _call(handlers, {"jsonrpc": "2.0", "method": "add", "params": [1, 2]}) is None  # notification
    # an id is a string, a number or null: true is none of them (though Python's bool is an int)
    assert _call(handlers, {"jsonrpc": "2.0", "id": True, "method": "add"})["error"]["code"] == jsonrpc.INVALID_REQUEST


def test_jsonrpc_read_line_refuses_oversized_and_recovers():
    big = b"x" * (jsonrpc.MAX_REQUEST_BYTES + 10) + b"\n"
    stream = io.BufferedReader(io.BytesIO(big + b'{"ok":1}\n'))
    with pytest.raises(jsonrpc.RpcError) as info:
        jsonrpc.read_line(stream)
    assert info.value.code == jsonrpc.INVALID_REQUEST
    assert jsonrpc.read_line(stream) == b'{"ok":1}\n'
    assert jsonrpc.read_line(stream) is None


def test_split_host_port():
    from turbonode.config import split_host_port

    assert split_host_port("127.0.0.1:8460") == ("127.0.0.1", 8460)
    assert split_host_port("[::1]:9465") == ("::1", 9465)
    assert split_host_port(":0") == ("0.0.0.0", 0)


def test_the_docs_name_every_throttle_field():
    """The throttle's fields are defined once (turbonode.throttle_params.ThrottleLimits); the docs
    that list them by hand must follow."""
    docs = ROOT / "docs"
    design = re.search(r"^\| `throttle` \|.*$", (docs / "design.md").read_text(), re.M)
    worker = re.search(r"^\* `throttle\(.*?\)`", (docs / "worker.md").read_text(), re.M | re.S)
    assert design and worker
    for listed in (design.group(0), worker.group(0)):
        assert [k for k in THROTTLE_KEYS if not re.search(rf"\b{k}\b", listed)] == []
