"""Imported by the suite's multiprocessing forkserver before its first fork: the heavy modules
its children would each import (tests/forked.py's ``FORKSERVER_PRELOAD``)."""

from tests.forked import preload_forkserver

preload_forkserver()
