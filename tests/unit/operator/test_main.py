"""The command line refuses unusable settings with a message naming the flag."""

from __future__ import annotations

import pytest

from kuberl_operator.__main__ import parse_args


def test_scope_is_required(capsys):
    with pytest.raises(SystemExit):
        parse_args([])
    assert "--namespace NS" in capsys.readouterr().err


def test_bad_backoff_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(["-n", "a", "--restart-backoff", "0"])
    assert "--restart-backoff must be > 0" in capsys.readouterr().err


def test_namespaces_repeat_and_peering_turns_off_standalone():
    args = parse_args(["-n", "a", "-n", "b", "--peering", "kuberl"])
    assert args.namespace == ["a", "b"] and args.peering == "kuberl"
    assert parse_args(["--all-namespaces"]).all_namespaces


@pytest.mark.parametrize("price", ["-1", "nan", "inf"])
def test_a_gpu_hour_price_that_is_not_a_price_names_the_chart_value(capsys, price):
    with pytest.raises(SystemExit):
        parse_args(["-n", "a", "--gpu-hour-price", price])
    assert "--gpu-hour-price (chart value operator.gpuHourPrice) must be a number >= 0" in capsys.readouterr().err
    assert parse_args(["-n", "a", "--gpu-hour-price", "2.5"]).gpu_hour_price == 2.5
