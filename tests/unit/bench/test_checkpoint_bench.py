"""Smoke test of bench/checkpoint.py at a tiny size: it runs end to end (save, commit, tar/gzip,
load and restore, each checked against the saved state) and writes the JSON it promises. No
timing assertions: the numbers mean something only at the default size."""

import json

from tests.unit.bench.scripts import load_bench


def test_checkpoint_bench_smoke(tmp_path, capsys):
    bench = load_bench("checkpoint.py")
    out = tmp_path / "out.json"
    work = tmp_path / "disk"
    work.mkdir()
    assert bench.main(["--size-gb", "0.002", "--dim", "256", "--repeat", "1", "--gzip-level", "1",
                       "--dir", str(work), "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("headline: stall training sees = ")
    result = json.loads(out.read_text())
    for key in ("machine", "disk", "size_gb", "state_bytes", "rows", "stall_over_plain_write",
                "written_over_plain_write", "durable_over_plain_write", "load_vs_plain_read",
                "goal_stall_over_plain_write"):
        assert key in result, key
    names = [r["name"] for r in result["rows"]]
    assert names == ["plain write", "stall", "written", "durable dcp", "durable tar", "tar package",
                     "gzip package", "plain read", "load dcp", "load tar"]
    for row in result["rows"]:
        assert {"label", "seconds", "median_seconds", "gbps", "reference", "ratio"} <= row.keys()
        assert row["seconds"] > 0 and row["gbps"] > 0
    assert result["state_bytes"] > 0 and result["checkpoint_bytes"] >= result["state_bytes"]
    assert list(work.iterdir()) == [], "the benchmark removes what it wrote"
