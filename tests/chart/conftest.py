"""The chart's example script, loaded from the chart folder it ships in."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLE = (
    Path(__file__).resolve().parents[2] / "helm" / "shardcache" / "examples"
) / "ray_train.py"


@pytest.fixture(scope="session")
def ray_train_example() -> ModuleType:
    """helm/shardcache/examples/ray_train.py as a module."""
    import ray.cloudpickle

    spec = importlib.util.spec_from_file_location(
        "shardcache_ray_train_example", EXAMPLE
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    # Submitted as a job the script is __main__ and pickled by value; imported
    # here, its functions must be too, since Ray workers cannot import the file.
    ray.cloudpickle.register_pickle_by_value(module)
    return module
