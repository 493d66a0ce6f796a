"""The netns sandbox every kernel test and benchmark builds on."""

import subprocess

from tests.helpers import needs_root


@needs_root
def test_sandbox_connects_and_cleans_up():
    from sandbox.netns import Sandbox

    with Sandbox() as sb:
        names = (sb.server, sb.client)
        sb.run(sb.client, "ping", "-c", "1", "-W", "2", sb.server_ip)
        sb.run(sb.client, "ping", "-6", "-c", "1", "-W", "2", sb.server_ip6)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)


@needs_root
def test_sandbox_deleted_when_body_fails():
    import pytest

    from sandbox.netns import Sandbox

    sb = Sandbox()
    with pytest.raises(RuntimeError):
        with sb:
            raise RuntimeError("boom")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert sb.server not in listed and sb.client not in listed
