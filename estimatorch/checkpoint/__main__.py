"""``python -m estimatorch.checkpoint``: see :func:`estimatorch.checkpoint.main`."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
