from click.testing import CliRunner

from turboctl import main


def test_config_check_ok_and_bad(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[qos]\nrate = "100mbit"\n')
    bad = tmp_path / "bad.toml"
    bad.write_text("[worker]\nmax_batch = -2\n")
    runner = CliRunner()
    res = runner.invoke(main, ["config", "check", str(good)])
    assert res.exit_code == 0 and "OK" in res.output
    res = runner.invoke(main, ["config", "check", str(bad)])
    assert res.exit_code == 1 and "worker.max_batch" in res.output
    res = runner.invoke(main, ["config", "check", "--json", str(good)])
    assert res.exit_code == 0 and '"rate": "100mbit"' in res.output
