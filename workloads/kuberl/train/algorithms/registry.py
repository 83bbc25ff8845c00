"""The algorithms by ``spec.algorithm.name``. A new algorithm is one module beside this one, its
entry here and its name in ``kuberl.api.types.AlgorithmName``."""

from __future__ import annotations

from kuberl.train.algorithms.base import Algorithm
from kuberl.train.algorithms.dapo import DAPO
from kuberl.train.algorithms.dr_grpo import DrGRPO
from kuberl.train.algorithms.grpo import GRPO
from kuberl.train.algorithms.gspo import GSPO
from kuberl.train.algorithms.rloo import RLOO

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (GRPO(), DrGRPO(), DAPO(), RLOO(), GSPO())}


def get(name: str) -> Algorithm:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"spec.algorithm.name: unknown algorithm {name!r}; choose one of "
                         f"{', '.join(sorted(ALGORITHMS))}") from None
