"""The real-node harness's pure parts (its nodes run in tests/e2e/nodes/test_real_nodes.py)."""

from tests.harness.nodes import host_resolvers


def test_host_resolvers_reads_ipv4_name_servers_other_than_loopback(tmp_path):
    conf = tmp_path / "resolv.conf"
    conf.write_text("search x\nnameserver 10.255.255.53\nnameserver 127.0.0.53\nnameserver fd00::1\n"
                    "nameserver 10.255.255.53\n")
    assert host_resolvers(conf) == ["10.255.255.53"]
    assert host_resolvers(tmp_path / "absent") == []
