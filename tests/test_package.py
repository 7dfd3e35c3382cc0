"""The package imports with only its core dependencies and exposes the fixed public names."""

import subprocess
import sys

import estimatorch


def test_public_names():
    for name in ("Estimator", "BatchProcessor", "History", "__version__", "rng", "metrics", "samplers"):
        assert hasattr(estimatorch, name), name


def test_import_does_not_pull_optional_dependencies():
    code = "import sys, estimatorch; print(sorted(m for m in ('matplotlib', 'IPython', 'tensorboard', 'mlflow', 'wandb', 'datasets', 'streaming', 'torchdata', 'transformers', 'pyarrow') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_import_paths_of_earlier_releases_name_the_moved_modules():
    """``estimatorch.cluster`` (moved into ``estimatorch.distributed``) is the same module object,
    so that what a script sets on one is seen through the other."""
    code = ("import estimatorch.cluster as old, estimatorch.distributed as d; from estimatorch import cluster; "
            "print(old is d.cluster, cluster is d.cluster, old.detect.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "estimatorch.distributed.cluster"]
