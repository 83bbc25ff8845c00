"""RL algorithms behind one seam (``base.Algorithm``), chosen by ``spec.algorithm.name`` from
``registry.ALGORITHMS``; docs/algorithms.md has each one's equations."""
