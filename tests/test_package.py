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
