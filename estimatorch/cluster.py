"""The import path of earlier releases: ``estimatorch.cluster`` is
:mod:`estimatorch.distributed.cluster` (the same module object, so that what you set on one is
set on the other)."""

import sys

from .distributed import cluster

sys.modules[__name__] = cluster
