"""bench/ holds scripts, not a package: a test loads one by its file name."""

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"


def load_bench(file_name: str) -> ModuleType:
    """``bench/<file_name>`` as a module (its ``main`` is not run)."""
    spec = importlib.util.spec_from_file_location(f"kuberl_bench_{Path(file_name).stem}", BENCH_DIR / file_name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
