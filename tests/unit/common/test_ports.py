"""``unclaimed_port`` draws outside the range the kernel hands to outgoing connections: the race
that cost a CI run (a gloo store's port taken between 'bind 0, close' and the store's bind)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kuberl.common.ports import PORT_RANGE, unclaimed_port


def test_the_port_is_bindable_and_below_the_kernels_ephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = unclaimed_port()
        assert port in PORT_RANGE and port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_skipped_and_an_exhausted_search_names_the_range(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", PORT_RANGE.start))
        monkeypatch.setattr("kuberl.common.ports.random.sample", lambda population, k: [PORT_RANGE.start] * k)
        with pytest.raises(OSError, match=f"{PORT_RANGE.start}-{PORT_RANGE.stop - 1}"):
            unclaimed_port(attempts=3)
