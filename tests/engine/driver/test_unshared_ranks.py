"""Two gloo trainer ranks that share no filesystem, as in two pods: each runs in its own mount
namespace with a private tmpfs at the same scratch path (its checkpoint shards and its TMPDIR go
there), so neither can see what the other writes, and all of it is gone when the rank exits.

Run U trains 6 steps uninterrupted. Run K saves a checkpoint at step 3 to moto's S3 server on
loopback (each rank uploads its own shards; rank 0 commits once both are durable), trains on and
is SIGKILLed in step 5. Run R starts fresh ranks in fresh namespaces, restores step 3 straight from
S3 and trains steps 4-6: the losses are bit-identical to run U's. The rank processes are the real
checkpoint code (``RankCheckpointer``) on real FSDP2 + AdamW state (``tests.engine.driver.one_rank``);
what stands in for the driver's Ray calls is a gather of the upload records to rank 0.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kuberl.common.ports import unclaimed_port

# Six rank processes start one after another pair; on a loaded 2-core machine that is minutes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

RANK = textwrap.dedent("""
    import json, os, signal, sys
    from pathlib import Path
    import torch.distributed as dist
    from kuberl.job.plan import Checkpoints, Resume
    from kuberl.train.checkpoint import RankCheckpointer, find_checkpoint
    from tests.engine.driver.one_rank import OneRank

    rank, port, root, mode, out, scratch = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], Path(sys.argv[6])
    (scratch / "tmp").mkdir()
    (scratch / f"rank-{rank}-was-here").touch()
    worker = OneRank(layers=3, dim=64, seed=0, rank=rank, world_size=2, port=port)
    dist.barrier()
    # The other rank wrote its marker at the same path, in its own namespace: not visible here.
    assert sorted(p.name for p in scratch.iterdir()) == ["rank-%d-was-here" % rank, "tmp"], list(scratch.iterdir())
    spec = Checkpoints(root=root, interval_steps=3, keep=2, format="dcp", export_hugging_face=False, export_uri=None)
    saver = RankCheckpointer(worker, spec, scratch / "checkpoints")
    worker.before_update = saver.fence
    losses, first = {}, 1
    if mode == "resume":
        found = [find_checkpoint(Resume(newest_under=root)) if rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        state = saver.load(found[0])
        first = state["step"] + 1
    for step in range(first, 7):
        losses[step] = worker.step(data_seed=1000 * step + rank)
        if mode == "killed" and step == 3:
            saver.save(3)
        if mode == "killed" and step == 4:
            files = [None, None]
            dist.gather_object(saver.uploaded(3), files if rank == 0 else None, dst=0)
            if rank == 0:
                saver.commit(3, [f for part in files for f in part], {"weight_version": 3})
            dist.barrier()
            if rank == 0:
                Path(out).write_text(json.dumps(losses))
            os.kill(os.getpid(), signal.SIGKILL)  # mid-way into step 5, nothing cleaned up
    if rank == 0:
        Path(out).write_text(json.dumps(losses))
    saver.close()
""")


def _run(mode: str, root: str, tmp: Path, env: dict[str, str]) -> tuple[dict[int, float], list[int]]:
    port = unclaimed_port()
    out = tmp / f"{mode}.json"
    procs = []
    for rank in (0, 1):
        scratch = tmp / "scratch"  # the same path for both ranks, a different tmpfs in each namespace
        scratch.mkdir(exist_ok=True)
        command = (f"mount -t tmpfs kuberl-rank-{rank} {scratch} && TMPDIR={scratch}/tmp exec {sys.executable} "
                   f"-c \"$RANK_SCRIPT\" {rank} {port} {root} {mode} {out} {scratch}")
        procs.append(subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", command],
                                      env={**env, "RANK_SCRIPT": RANK}, cwd=Path(__file__).resolve().parents[3],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    codes = []
    for proc in procs:
        output, _ = proc.communicate(timeout=600)
        codes.append(proc.returncode)
        if mode != "killed":
            assert proc.returncode == 0, output
    assert not list((tmp / "scratch").iterdir()), "a rank's files are in its own namespace only"
    return {int(k): v for k, v in json.loads(out.read_text()).items()}, codes


@pytest.fixture(scope="module")
def unshare_works(tmp_path_factory):
    if not shutil.which("unshare"):
        pytest.skip("needs unshare(1) to give each rank its own mount namespace")
    probe = tmp_path_factory.mktemp("probe")
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                             f"mount -t tmpfs probe {probe}"], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot make a private mount namespace here: {result.stderr.strip()}")


def test_ranks_without_a_shared_filesystem_resume_bit_identically(unshare_works, s3, s3_env, tmp_path):
    fs, bucket = s3
    env = {**os.environ, **s3_env}
    uninterrupted, _ = _run("uninterrupted", f"s3://{bucket}/unshared-u", tmp_path, env)
    assert sorted(uninterrupted) == [1, 2, 3, 4, 5, 6]

    root = f"s3://{bucket}/unshared-k"
    before_kill, codes = _run("killed", root, tmp_path, env)
    assert codes == [-9, -9] or all(c != 0 for c in codes), codes
    assert before_kill == {s: uninterrupted[s] for s in (1, 2, 3, 4)}
    fs.invalidate_cache()
    complete = json.loads(fs.cat_file(f"{bucket}/unshared-k/step-000000003/COMPLETE"))
    assert {f["path"] for f in complete["files"]} == {
        "driver.json", "trainer/.metadata", "trainer/__0_0.distcp", "trainer/__1_0.distcp",
        "trainer/trainer_rank0_of2.pt", "trainer/trainer_rank1_of2.pt"}

    resumed, _ = _run("resume", root, tmp_path, env)
    assert sorted(resumed) == [4, 5, 6]
    for step in resumed:
        assert repr(resumed[step]) == repr(uninterrupted[step]), f"step {step} differs after resuming"
