"""Two gloo ranks in real Ray actors (``TrainerGroup``) train tiny dense and Qwen3-MoE models with
non-reentrant activation checkpointing; non-finite steps, per-rank checkpoints to S3 (saved in the
background while training goes on) and restore, HF export to the checkpoint URI."""

from __future__ import annotations

import json

import hashlib
import math
import random

import pytest
import ray
import torch

from kuberl.api.types import RLTrainingJob, RLTrainingJobSpec
from kuberl.common.samples import Sample, TrainBatch
from kuberl.driver.tiny import make_model
from kuberl.job import plan as plans
from kuberl.train.group import TrainerGroup
from tests.shared.stores import S3_ENV

STEP_TIMEOUT_S = 120  # a hang fails the test instead of blocking CI


@pytest.fixture(scope="module", autouse=True)
def s3_endpoint(ray_session):
    """The session's moto S3 server: the trainer ranks stage the model from it themselves."""
    return ray_session


@pytest.fixture(scope="module")
def moe_s3_uri(moe_path, s3_endpoint):
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, key=S3_ENV["AWS_ACCESS_KEY_ID"],
                           secret=S3_ENV["AWS_SECRET_ACCESS_KEY"], skip_instance_cache=True)
    fs.mkdir("models")
    fs.put(str(moe_path) + "/", "models/qwen3-moe-tiny/", recursive=True)
    return "s3://models/qwen3-moe-tiny"


def _spec(model_path, checkpoint=None, trainer=None, **algorithm) -> RLTrainingJobSpec:
    return RLTrainingJobSpec.model_validate({
        "model": {"uri": str(model_path)}, "data": {"uri": "/data/prompts.jsonl"}, "image": "kuberl:test",
        "trainer": {"gpusPerReplica": 0, "processesPerReplica": 2, "gradientCheckpointing": True, **(trainer or {})},
        "algorithm": {"microBatchSize": 2, "learningRate": 1e-3, "weightDecay": 0.1, "warmupSteps": 2,
                      **algorithm},
        "checkpoint": checkpoint or {},
    })


def _group(spec: RLTrainingJobSpec, work_dir) -> TrainerGroup:
    job = RLTrainingJob(metadata={"name": "group-test"}, spec=spec)
    return TrainerGroup(spec, plans.local(job, work_dir))


def test_a_group_without_resources_fails_naming_the_wait(dense_path, tmp_path):
    """What a lost rank's replacement group does when no capacity comes back (KubeRay's new pod
    never joins): a bounded wait, then an error the driver passes on (a new attempt takes over).
    One GPU per rank on this CPU-only Ray: never placed."""
    from kuberl.train.group import TrainerCapacityError

    spec = _spec(dense_path, trainer={"gpusPerReplica": 1, "processesPerReplica": 1})
    job = RLTrainingJob(metadata={"name": "group-test"}, spec=spec)
    with pytest.raises(TrainerCapacityError, match=r"only 0 of 1 trainer ranks got their resources \(1 GPUs each\) "
                                                   r"within 2 s"):
        TrainerGroup(spec, plans.local(job, tmp_path), ready_timeout=2)


def _batch(n=8, seed=0) -> TrainBatch:
    rng = random.Random(seed)
    return TrainBatch([Sample(prompt_ids=[rng.randrange(4, 100) for _ in range(rng.randrange(3, 9))],
                              response_ids=[rng.randrange(4, 100) for _ in range(rng.randrange(2, 10))],
                              advantage=rng.uniform(-1, 1), group=i // 2) for i in range(n)])



def _state_digest(worker) -> dict:
    """Hash of this rank's parameter shards, optimizer state and counters (bit-exact)."""
    h = hashlib.sha256()
    for name, p in sorted(worker.model.state_dict().items()):
        h.update(name.encode())
        h.update(p.to_local().detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for state in worker.optimizer.state.values():
        for key, t in sorted(state.items()):
            t = t.to_local() if hasattr(t, "to_local") else torch.as_tensor(t)
            h.update(key.encode())
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return {"digest": h.hexdigest(), "lr": worker.scheduler.get_last_lr()[0],
            "scheduler_epoch": worker.scheduler.last_epoch, "optimizer_steps": worker.optimizer_steps}


def _expert_usage(worker, batch: TrainBatch) -> list[int]:
    """Which experts of layer 0 this rank's share of ``batch`` routes to (counts per expert)."""
    from kuberl.train.worker import make_micro_batch

    counts = []
    gate = worker.model.model.layers[0].mlp.gate
    handle = gate.register_forward_hook(lambda m, args, out: counts.append(torch.bincount(
        out[2].reshape(-1), minlength=m.num_experts)))
    try:
        mine = batch.shard(worker.rank, worker.world_size)
        with torch.no_grad():
            mb = make_micro_batch(mine, worker.device)
            worker.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask)
    finally:
        handle.remove()
    return counts[0].tolist()


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("dense") / "model", moe=False, seed=1)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("moe") / "model", moe=True, seed=2)


def test_dense_trains_with_training_numerics_and_skips_non_finite(dense_path, tmp_path):
    group = _group(_spec(dense_path, klCoef=0.05), tmp_path)
    try:
        batch = _batch()
        batch.old_logprobs = group.log_probs(batch)
        batch.ref_logprobs = group.ref_log_probs(batch)
        assert [len(x) for x in batch.old_logprobs] == [len(s.response_ids) for s in batch.samples]
        first = group.train_step(batch)
        # log_probs uses the training numerics: at the first step the ratio is exactly 1 (nothing
        # clipped), the policy is the reference (KL 0), and pg_loss is minus the token-mean advantage.
        tokens = sum(len(s.response_ids) for s in batch.samples)
        mean_adv = sum(s.advantage * len(s.response_ids) for s in batch.samples) / tokens
        assert first["clip_frac"] == 0.0 and first["kl"] == pytest.approx(0.0, abs=1e-7)
        assert first["pg_loss"] == pytest.approx(-mean_adv, rel=1e-5)
        assert first["tokens"] == tokens and first["skipped"] == 0.0
        assert first["lr"] == pytest.approx(1e-3 / 2)  # warm-up step 1 of 2
        for _ in range(3):
            metrics = group.train_step(batch)
            assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        assert group.log_probs(batch) != batch.old_logprobs  # the weights moved

        before = group.execute(_state_digest)
        bad = TrainBatch(list(batch.samples), batch.old_logprobs, batch.ref_logprobs)
        bad.samples = [*batch.samples[:-1], Sample(**{**vars(batch.samples[-1]), "advantage": float("nan")})]
        skipped = group.train_step(bad)  # the NaN sample is on rank 1 only: both ranks must skip
        after = group.execute(_state_digest)
        assert skipped["skipped"] == 1.0 and skipped["skipped_total"] == 1.0
        assert not math.isfinite(skipped["grad_norm"])
        assert after == before  # parameters, AdamW moments and step, LR schedule: bit-identical
        assert group.train_step(batch)["skipped"] == 0.0  # and training goes on
    finally:
        group.shutdown()


def test_moe_ranks_route_differently_and_train_without_hang(moe_path, tmp_path):
    # The load-balancing loss is off by default (as in the peers); on here, so the router's
    # logits take part in the update and its value is reported.
    group = _group(_spec(moe_path, trainer={"moe": {"routerAuxLossCoef": 0.01}}, klCoef=0.0), tmp_path)
    try:
        # Rank 1 gets only token 5 repeated: it routes everything to the same two experts, while
        # rank 0's varied tokens spread over others. Some expert gets no token on rank 1.
        rng = random.Random(3)
        samples = [Sample(prompt_ids=[rng.randrange(4, 100) for _ in range(6)],
                          response_ids=[rng.randrange(4, 100) for _ in range(6)], advantage=1.0) for _ in range(4)]
        samples += [Sample(prompt_ids=[5] * 6, response_ids=[5] * 6, advantage=-1.0) for _ in range(4)]
        batch = TrainBatch(samples)
        usage = group.execute(_expert_usage, batch)
        assert usage[0] != usage[1]
        assert 0 in usage[1]
        for _ in range(4):
            ref = ray.get([a.call.remote("train_step", batch) for a in group.actors], timeout=STEP_TIMEOUT_S)
            assert ref[0] == ref[1]  # every rank reports the same once-reduced metrics
            assert ref[0]["skipped"] == 0.0 and ref[0]["aux_loss"] > 0
    finally:
        group.shutdown()


def _s3fs(endpoint):
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=endpoint, key=S3_ENV["AWS_ACCESS_KEY_ID"],
                             secret=S3_ENV["AWS_SECRET_ACCESS_KEY"], skip_instance_cache=True)


def test_per_rank_checkpoint_saves_in_background_resumes_bit_exactly_and_exports_hf(
        moe_s3_uri, s3_endpoint, tmp_path):
    fs = _s3fs(s3_endpoint)
    fs.mkdir("group-ckpt")
    root = "s3://group-ckpt/run"
    # Model from S3: every rank stages it through kuberl.storage.resolve on its own; each rank
    # writes its shards below its own scratch directory and uploads them itself.
    group = _group(_spec(moe_s3_uri, {"uri": root, "format": "dcp"}, klCoef=0.0), tmp_path)
    try:
        batch = _batch(seed=5)
        group.train_step(batch)
        saved = group.execute(_state_digest)
        group.save_checkpoint(3)
        rng_at_save = group.execute(lambda w: torch.rand(2).tolist())
        # Training goes on at once; the next optimizer step waits until the state is written.
        run1 = [group.train_step(batch) for _ in range(2)]
        files = group.checkpoint_uploaded(3)
        assert {f["path"] for f in files} >= {"trainer/.metadata", "trainer/__0_0.distcp", "trainer/__1_0.distcp",
                                               "trainer/trainer_rank0_of2.pt", "trainer/trainer_rank1_of2.pt"}
        uri = group.commit_checkpoint(3, files, {"weight_version": 7})
        assert uri == f"{root}/step-000000003"
        assert fs.cat_file("group-ckpt/run/latest") == b"step-000000003"
        # Each rank's scratch holds nothing of the checkpoint once it is uploaded.
        assert not [p for p in (tmp_path / "scratch").rglob("*.distcp")]

        assert group.find_checkpoint(plans.Resume(newest_under=root)) == uri
        state = group.load_checkpoint(uri)
        assert state == {"weight_version": 7, "step": 3}
        assert group.execute(_state_digest) == saved  # the state at save, not after the 2 steps
        # Every RNG is restored: the draws after the resume are those after the save.
        assert group.execute(lambda w: torch.rand(2).tolist()) == rng_at_save
        run2 = [group.train_step(batch) for _ in range(2)]
        # Each the same but its wait for the checkpoint (a time: run 1's first step waited).
        assert [dict(r, checkpoint_wait=0.0) for r in run1] == [dict(r, checkpoint_wait=0.0) for r in run2]

        # Writing step 3 again withdraws the old one first: killed mid-way, no COMPLETE vouches
        # for a mix of old and new shards.
        fs.invalidate_cache()
        group.save_checkpoint(3)
        fs.invalidate_cache()
        assert not fs.exists("group-ckpt/run/step-000000003/COMPLETE")
        group.commit_checkpoint(3, group.checkpoint_uploaded(3), {"weight_version": 9})
        fs.invalidate_cache()
        assert fs.exists("group-ckpt/run/step-000000003/COMPLETE")

        # A file removed after COMPLETE vouched for it: the restore refuses the step, naming it.
        fs.rm("group-ckpt/run/step-000000003/trainer/trainer_rank1_of2.pt")
        with pytest.raises(ray.exceptions.RayTaskError, match=r"trainer/trainer_rank1_of2.pt is missing"):
            group.load_checkpoint(uri)
        # A complete checkpoint without this world size's per-rank files (COMPLETE agrees: as one
        # written by another number of ranks) is refused with the reason.
        manifest = json.loads(fs.cat_file("group-ckpt/run/step-000000003/COMPLETE"))
        manifest["files"] = [f for f in manifest["files"] if f["path"] != "trainer/trainer_rank1_of2.pt"]
        fs.pipe_file("group-ckpt/run/step-000000003/COMPLETE", json.dumps(manifest).encode())
        fs.invalidate_cache()
        with pytest.raises(ray.exceptions.RayTaskError, match="same world size"):
            group.load_checkpoint(uri)
        assert group.export_hugging_face(f"{root}/hf") == f"{root}/hf"
        logprobs = group.log_probs(batch)
    finally:
        group.shutdown()
    fs.get("group-ckpt/run/hf/", str(tmp_path / "hf"), recursive=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").eos_token == "<|im_end|>"
    assert any(p.name.endswith(".safetensors") for p in (tmp_path / "hf").iterdir())
    s = batch.samples[0]
    with torch.no_grad():
        logits = exported(torch.tensor([s.prompt_ids + s.response_ids])).logits[0, :-1]
    lp = torch.log_softmax(logits.float(), -1)[torch.arange(logits.shape[0]), torch.tensor(s.prompt_ids + s.response_ids)[1:]]
    start = len(s.prompt_ids) - 1
    torch.testing.assert_close(lp[start:start + len(s.response_ids)], torch.tensor(logprobs[0]), rtol=1e-4, atol=1e-4)
