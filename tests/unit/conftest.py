"""Tier 1, `tests/unit`: pure and fast. In-process code only: no Ray, no vLLM, no cluster, no servers
in child processes (loopback servers in threads of this process are fine). Goal: the whole tier in
at most 60 s on a 2-core machine (docs/development.md)."""

from tests.tiers import tier_marker

pytest_collection_modifyitems = tier_marker(__file__)
