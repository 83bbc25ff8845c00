import pytest

from kuberl.numa import CpuListError, format_cpulist, parse_cpulist, split_cores


def test_parse_and_format_round_trip():
    cpus = parse_cpulist("0-55,112-167\n")
    assert len(cpus) == 112
    assert format_cpulist(cpus) == "0-55,112-167"
    assert parse_cpulist("") == frozenset()
    assert format_cpulist([3, 1, 2, 7]) == "1-3,7"


@pytest.mark.parametrize("bad", ["a-b", "5-3", "1,x"])
def test_parse_errors_name_the_source(bad):
    with pytest.raises(CpuListError, match="node0/cpulist"):
        parse_cpulist(bad, "node0/cpulist")


def test_fewer_cores_than_gpus_share_round_robin():
    assert split_cores(frozenset({4, 5}), {}, 3) == [frozenset({4}), frozenset({5}), frozenset({4})]
    assert split_cores(frozenset(), {}, 2) == [frozenset(), frozenset()]
