"""The driver's handle on all rollout engines: creation, batched generation, HTTP serving.

How many engines and what each asks Ray for come from the run plan. Colocated engines ask for no
GPU: each runs on the GPUs of ``tensorParallelSize`` trainer ranks of one node (which Ray gave
those ranks), pinned to that node, and sleeps while the trainer steps."""

from __future__ import annotations

import logging
import threading
import time

import ray

from kuberl.common.samples import Sample
from kuberl.job.plan import RunPlan

logger = logging.getLogger(__name__)


def colocated_devices(gpu_slots: list[tuple[str, str]], tensor_parallel_size: int) -> list[tuple[str, list[str]]]:
    """(node, GPU ids) of each colocated engine: the trainer ranks' GPUs (``gpu_slots``: node id
    and Ray GPU id per rank) grouped by node, cut into tensor-parallel groups."""
    by_node: dict[str, list[str]] = {}
    for node, gpu in gpu_slots:
        by_node.setdefault(node, []).append(gpu)
    out = []
    for node, gpus in by_node.items():
        if len(gpus) % tensor_parallel_size:
            raise ValueError(f"node {node} has {len(gpus)} trainer GPUs, not a multiple of "
                             f"rollout.tensorParallelSize {tensor_parallel_size}")
        out += [(node, gpus[i:i + tensor_parallel_size]) for i in range(0, len(gpus), tensor_parallel_size)]
    return out


def shares(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, non-empty ``[start, end)`` shares of the prompts ``lo..hi`` for ``parts``
    engines (fewer shares than engines when there are fewer prompts)."""
    if parts < 1:
        raise ValueError(f"no engine to share prompts {lo}..{hi} among")
    per = max(1, -(-(hi - lo) // parts))
    return [(start, min(start + per, hi)) for start in range(lo, hi, per)]


class EnginesLost(RuntimeError):
    """Every rollout engine of the pool is gone: nothing is left to generate on."""


class Redispatch:
    """Which prompts of one batch are out, on which engine, and which are done: a lost engine's
    share goes back out, split over the engines still live, with its prompts' own indices (so the
    same per-prompt seeds). Pure bookkeeping; ``EnginePool.generate`` does the Ray calls."""

    def __init__(self, count: int):
        self.count = count
        self.out: dict[object, tuple[object, int, int]] = {}  # ticket -> (engine, start, end)
        self.done: dict[int, list] = {}  # start -> that share's groups

    def plan(self, lo: int, hi: int, live: list) -> list[tuple[object, int, int]]:
        """The (engine, start, end) requests to make for prompts ``lo..hi`` over ``live``."""
        if not live:
            raise EnginesLost(f"every rollout engine is lost: prompts {lo}..{hi} of the batch have no engine "
                              f"to go to; the warnings before this name each engine's cause")
        return [(engine, start, end) for engine, (start, end) in zip(live, shares(lo, hi, len(live)))]

    def sent(self, ticket, engine, start: int, end: int) -> None:
        self.out[ticket] = (engine, start, end)

    def finished(self, ticket, groups: list) -> None:
        engine, start, end = self.out.pop(ticket)
        if len(groups) != end - start:
            raise RuntimeError(f"engine answered {len(groups)} groups for prompts {start}..{end}")
        self.done[start] = groups

    def lost(self, ticket) -> tuple[object, int, int]:
        """The lost request's (engine, start, end): its prompts are to send again."""
        return self.out.pop(ticket)

    def result(self) -> list:
        groups = [group for start in sorted(self.done) for group in self.done[start]]
        if self.out or len(groups) != self.count:
            raise RuntimeError(f"{len(groups)} of {self.count} groups done, {len(self.out)} requests out")
        return groups


class EnginePool:
    """The live engines (``engines``), and the count wanted (``wanted``). An engine whose actor
    dies (``ray.kill``, a crash, its pod or node gone) is dropped from the live set where a call
    finds it dead; ``generate`` re-sends its share to the others. ``replenish`` (at a step
    boundary) starts a replacement for each missing engine, with the same spec and placement, and
    admits those that have started: on a local Ray at once, in a KubeRay cluster once the
    replacement pod has joined and given Ray the resources the engine asks for (until then its
    actor waits in Ray's queue and the pool runs on the engines left)."""

    def __init__(self, spec, plan: RunPlan, served_model_name: str, *, num_engines: int | None = None,
                 gpu_slots: list[tuple[str, str]] | None = None, wait: bool = True):
        """``gpu_slots``: the trainer ranks' (node, GPU id), required when colocated on GPUs.
        ``wait``: return once every engine has started; False returns at once, and ``wait_ready``
        waits (so the caller can start the trainer ranks beside the engines)."""
        self.spec = spec
        self.paths = plan.paths
        self.served_model_name = served_model_name
        layout = plan.layout
        self.colocated = layout.colocated
        self.expert_parallel = layout.engine_expert_parallel
        count = num_engines if num_engines is not None else layout.engines
        if count < 1:
            raise ValueError(f"num_engines must be at least 1, got {count}")
        self._options = {"num_gpus": layout.gpus_per_engine, "max_concurrency": 1000,
                         **layout.slot_reservation(layout.rollout_resource)}
        if spec.rollout.env:
            self._options["runtime_env"] = {"env_vars": dict(spec.rollout.env)}
        self._placements: list[tuple[str | None, list[str] | None]] = [(None, None)] * count
        if layout.colocated and layout.gpus_per_rank:
            self._placements = colocated_devices(gpu_slots or [], layout.tensor_parallel_size)[:count]
            if len(self._placements) < count:
                raise ValueError(f"{count} colocated engines need {count * layout.tensor_parallel_size} "
                                 f"trainer GPUs; the trainer ranks hold {len(gpu_slots or [])}")
        self.wanted = count
        self._lock = threading.Lock()  # generate may run in the rollout thread (asyncRollout)
        self._slots: dict[object, int] = {}  # live engine -> its engine index (seed, placement)
        self._starting: dict[object, tuple[object, int]] = {}  # ready ref -> (engine, index)
        self.lost = self.replaced = 0  # since the last take_counts()
        self._lost_at: list[float] = []  # when each loss not yet replaced happened (monotonic)
        self.replacement_seconds: list[float] = []  # loss -> replacement joined, since the last take_counts()
        self.engines = [self._start(i) for i in range(count)]
        self._slots = dict(zip(self.engines, range(count)))
        self._started = [engine.vocab_size.remote() for engine in self.engines]
        self.vocab_size: int | None = None
        self._server = None
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait for the first engines' start. Start-up failures (bad model path, vLLM errors)
        surface here, not at the first request. The vocabulary (one model, so every engine's is
        the same) bounds the endpoint's token ids."""
        if self.vocab_size is None:
            self.vocab_size = ray.get(self._started)[0]

    def _start(self, index: int):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from kuberl.rollout.engine import RolloutEngine

        node, devices = self._placements[index % len(self._placements)]
        where = ({"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
                 if node is not None else {})
        return ray.remote(RolloutEngine).options(**self._options, **where).remote(
            self.spec, self.paths, self.served_model_name, engine_index=index, devices=devices,
            expert_parallel=self.expert_parallel)

    # --- membership ----------------------------------------------------------------------------

    @property
    def members(self) -> tuple:
        """The live engines: what a weight sync's group was built for."""
        return tuple(self.engines)

    def drop(self, engine, cause: BaseException) -> None:
        """``engine`` failed a call (``cause``): out of the live set, killed, counted and logged once.

        The kill is for the engine that Ray reports unreachable while it lives on: Ray raises the
        same ``ActorUnavailableError`` for a broken connection as for a crashed pod, and such an
        engine would hold its slot and GPU, which its replacement needs, and stay in no group."""
        with self._lock:
            if engine not in self._slots:
                return
            index = self._slots.pop(engine)
            self.engines = [e for e in self.engines if e is not engine]
            self.lost += 1
            self._lost_at.append(time.monotonic())
        ray.kill(engine, no_restart=True)
        logger.warning("rollout engine %d lost (%s: %s); %d of %d engines live", index, type(cause).__name__,
                       str(cause).splitlines()[0] if str(cause) else "", len(self.engines), self.wanted)

    def resize(self, wanted: int) -> None:
        """Run ``wanted`` engines: more start at once and join through ``replenish``; fewer retire
        the newest live ones now (call at a step boundary)."""
        if wanted < 1:
            raise ValueError(f"rollout engines: at least 1 wanted, got {wanted}")
        self.wanted = wanted
        del self._lost_at[max(0, wanted - len(self.engines)):]  # losses no engine will replace now
        while self._starting and len(self.engines) + len(self._starting) > wanted:
            ray.kill(self._starting.popitem()[1][0])
        retired = self.engines[wanted:]
        with self._lock:
            for engine in retired:
                del self._slots[engine]
            self.engines = self.engines[:wanted]
        for engine in retired:
            self._stop(engine)

    def pods(self) -> list[str]:
        """The pods (host names) the live engines run in: in a KubeRay cluster, the rollout pods a
        scale-down must keep. Engines found dead are dropped."""
        return sorted(set(self.each("pod")))

    def replenish(self, timeout: float = 0.0) -> int:
        """At a step boundary: start an engine for each one missing from ``wanted`` (not already
        starting), then admit those whose start finished within ``timeout`` seconds; returns how
        many joined. A replacement that failed to start is logged and started again next time.
        Joined engines have the initial weights: the caller syncs the current ones to them."""
        taken = set(self._slots.values()) | {index for _, index in self._starting.values()}
        free = (i for i in range(len(self._slots) + len(self._starting) + self.wanted) if i not in taken)
        for _ in range(self.wanted - len(self.engines) - len(self._starting)):
            index = next(free)
            engine = self._start(index)
            self._starting[engine.vocab_size.remote()] = (engine, index)
            logger.info("rollout engine %d starting (%d of %d engines live); it joins at the first step "
                        "boundary after it has started", index, len(self.engines), self.wanted)
        if not self._starting:
            return 0
        ready, _ = ray.wait(list(self._starting), num_returns=len(self._starting), timeout=timeout)
        joined = 0
        for ref in ready:
            engine, index = self._starting.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:
                logger.warning("replacement rollout engine %d failed to start, retrying at the next step: %s",
                               index, err)
                ray.kill(engine)
                continue
            with self._lock:
                self._slots[engine] = index
                self.engines = [*self.engines, engine]
            self.replaced += 1
            if self._lost_at:  # a replacement, not an engine a resize added
                self.replacement_seconds.append(time.monotonic() - self._lost_at.pop(0))
            joined += 1
            logger.info("rollout engine %d joined; %d of %d engines live", index, len(self.engines), self.wanted)
        return joined

    def take_counts(self) -> dict[str, float]:
        """This step's ``engines_lost``, ``engines_replaced`` (every engine that joined), and of
        those the ``engine_replacements`` of lost engines with the longest
        ``engine_replacement_seconds`` (loss to joined), reset; and ``engines_live``."""
        counts = {"engines_lost": float(self.lost), "engines_replaced": float(self.replaced),
                  "engines_live": float(len(self.engines))}
        if self.replacement_seconds:
            counts.update(engine_replacements=float(len(self.replacement_seconds)),
                          engine_replacement_seconds=max(self.replacement_seconds))
        self.lost = self.replaced = 0
        self.replacement_seconds = []
        return counts

    def each(self, method: str, *args) -> list:
        """``method(*args)`` on every live engine; engines found dead are dropped."""
        return self.results([(engine, getattr(engine, method).remote(*args)) for engine in self.engines])

    def results(self, calls: list[tuple[object, object]]) -> list:
        """The results of (engine, ref) calls, each engine's in order; engines found dead are dropped
        (``EnginesLost`` if none is left), another error is raised."""
        out = []
        for engine, ref in calls:
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError as err:
                self.drop(engine, err)
        self._check_live()
        return out

    def _check_live(self) -> None:
        if not self.engines:
            raise EnginesLost(f"every rollout engine is lost ({self.lost} this step, {self.wanted} wanted); "
                              f"see the warnings above for each engine's cause")

    # --- work ----------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], n: int, temperature: float, max_tokens: int,
                 seed: int | None = None, **sampling) -> list[list[Sample]]:
        """Contiguous shares of ``prompts`` per engine; results in prompt order. ``sampling``:
        ``top_p``, ``top_k``, ``stop`` (``RolloutEngine.generate``). A share whose engine dies is
        sent again to the engines left, with the same prompt indices and so the same seeds."""
        if not prompts:
            return []
        batch = Redispatch(len(prompts))

        def send(lo: int, hi: int) -> None:
            for engine, start, end in batch.plan(lo, hi, list(self.engines)):
                batch.sent(engine.generate.remote(prompts[start:end], n, temperature=temperature,
                                                  max_tokens=max_tokens, seed=seed, group_offset=start, **sampling),
                           engine, start, end)

        send(0, len(prompts))
        while batch.out:
            (ref,), _ = ray.wait(list(batch.out), num_returns=1)
            try:
                batch.finished(ref, ray.get(ref))
            except ray.exceptions.RayActorError as err:
                engine, start, end = batch.lost(ref)
                self.drop(engine, err)
                send(start, end)
                logger.warning("prompts %d-%d of the batch, the lost engine's, sent again to the %d engine(s) left "
                               "(the same seeds)", start, end - 1, len(self.engines))
        return batch.result()

    def weight_versions(self) -> list[int]:
        return self.each("weight_version")

    def sleep(self) -> None:
        self.each("sleep")

    def wake_up(self) -> None:
        self.each("wake_up")

    def serve(self, tokenizer, host: str = "127.0.0.1", port: int = 0, episodes=None) -> str:
        """Start the OpenAI/Anthropic endpoint in a background thread; returns its base URL.
        ``tokenizer``: the model's (the driver's), which renders chats into prompt ids here so
        the engines only generate; ``episodes``: the ``EpisodeLog`` that records agent episodes
        (the driver's)."""
        from kuberl.rollout.server import BackgroundServer, make_app

        if self._server is None:
            self._server = BackgroundServer(make_app(self, tokenizer, episodes), host, port)
            self._server.start()
        return self._server.url

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        # Engines not known to have started (the trainer ranks failed while they were starting)
        # may wait in Ray's queue for ever, as replacements may: no call to them.
        for engine in self.engines:
            if self.vocab_size is None:
                ray.kill(engine)
            else:
                self._stop(engine)
        for engine, _ in self._starting.values():
            ray.kill(engine)
        self.engines, self._slots, self._starting = [], {}, {}

    @staticmethod
    def _stop(engine) -> None:
        try:
            ray.get(engine.shutdown.remote())
        except ray.exceptions.RayError as err:
            logger.warning("engine shutdown failed: %s", err)
        ray.kill(engine)
