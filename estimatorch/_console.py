"""Where the process runs: whether output goes to a Jupyter cell (the progress bars and the
one-line stop messages depend on it)."""

from __future__ import annotations

import sys

__all__ = ["in_notebook"]


def in_notebook() -> bool:
    """True in a Jupyter kernel (where bars go to a display output instead of a stream)."""
    if "ipykernel" not in sys.modules:
        return False
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return shell is not None and getattr(shell, "kernel", None) is not None
