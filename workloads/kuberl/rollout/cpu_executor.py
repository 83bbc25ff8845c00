"""The executor of CPU engines: vLLM's multiprocess executor, its workers forked from the engine core.

Runs in vLLM's EngineCore process. A kuberl engine is a Ray actor, and vLLM, seeing that, makes
its whole process tree start children with ``spawn``: it writes ``VLLM_WORKER_MULTIPROC_METHOD=
spawn`` into the actor's environment, and the EngineCore process it spawns inherits it. Spawning
the actor's child is right (forking a process with Ray's threads is not safe), but the EngineCore
process is no Ray actor, and there each spawned worker imported torch and vLLM again: 17 s of an
engine's 60 s start on a 2-core machine (docs/development.md, "Where a driver run's time goes").
This executor starts the workers as vLLM does outside Ray, by forking the engine core, whose
imports they share.

Only CPU engines take it (``kuberl.rollout.engine.engine_kwargs``): vLLM's CPU platform always
runs its workers in processes of their own, and a CPU engine core has no CUDA context a fork could
break. GPU engines keep vLLM's own choice.
"""

from __future__ import annotations

import os

from vllm.v1.executor.multiproc_executor import MultiprocExecutor

# vLLM's setting of the start method; ``vllm.utils.system_utils.get_mp_context`` reads it on
# every call, so the workers started below see this value.
START_METHOD_VARIABLE = "VLLM_WORKER_MULTIPROC_METHOD"


class ForkedWorkersExecutor(MultiprocExecutor):
    """``MultiprocExecutor`` whose worker processes are forked from the engine core."""

    def _init_executor(self) -> None:
        os.environ[START_METHOD_VARIABLE] = "fork"
        super()._init_executor()

