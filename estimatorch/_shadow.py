"""A folder named ``estimatorch`` beside a script (the clone of the repository, typically) that
hides the installed package from it.

Python imports such a folder as a namespace package when the package is installed in editable
mode (or not at all), and ``from estimatorch import CheckpointHandler`` then fails with
``ImportError: cannot import name 'CheckpointHandler' from 'estimatorch' (unknown location)``.
The failing script never runs estimatorch's code, so the package can only tell where it does
run: its command line (``python -m estimatorch demo``) warns about such a folder in the
directory it is started from, where the user is about to write a script.
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["shadowing_folder", "shadow_message"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def shadowing_folder(directory: str) -> Optional[str]:
    """The folder ``directory/estimatorch`` when it exists and is not this package (a clone of
    the repository, or another copy); None otherwise.

    Example:
        >>> shadowing_folder(os.path.dirname(_PACKAGE_DIR)) is None  # the package itself
        True
    """
    folder = os.path.join(directory, "estimatorch")
    if not os.path.isdir(folder):
        return None
    try:
        if os.path.samefile(folder, _PACKAGE_DIR):
            return None
    except OSError:  # vanished, or unreadable: nothing to say
        return None
    return folder


def shadow_message(folder: str) -> str:
    """What to tell about ``folder``: the error a script beside it gets, and the fixes."""
    what = "a clone of the repository" if os.path.isdir(os.path.join(folder, "estimatorch")) else "not this package"
    return (f"The folder {folder} ({what}) hides the estimatorch package from a script in "
            f"{os.path.dirname(folder)}: Python imports the folder instead, and `from estimatorch import ...` fails "
            "with \"cannot import name ... from 'estimatorch' (unknown location)\". Keep your scripts in another "
            "directory (or inside the clone), or rename the folder.")
