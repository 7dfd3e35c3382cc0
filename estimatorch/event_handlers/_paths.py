"""Where handlers write: check a directory or file argument before any work, and name the files
of a run so that a resumed run finds them under its own arguments.

A handler's state never holds a path (a checkpoint must not decide where files go): it holds a
*run id*, the time stamp in the names of the files a run writes, and the handler rebuilds the
path from its own ``log_dir`` and ``run_name``.
"""

from __future__ import annotations

import os
import re
import stat
import time
from typing import Any, Callable, Optional

__all__ = ["check_output_dir", "check_output_file", "check_run_id", "legacy_run_id", "new_run_id", "path_argument"]

#: what a run id may hold: one plain path component (letters, digits, ``_``, ``-``, ``.``)
_RUN_ID = re.compile(r"[\w.-]{1,64}")


def path_argument(value: Any, arg: str) -> str:
    """A non-empty ``str`` or ``os.PathLike``, as a ``str``; a ``TypeError`` naming ``arg`` else."""
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise TypeError(f"{arg} must be a path (a str or os.PathLike), got {value!r}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise TypeError(f"{arg} must be a str path, got bytes {value!r}")
    return path


def _kind(path: str) -> str:
    """What is at ``path`` in words (for a path that exists and is not a directory)."""
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        return "a file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a directory"


def _dangling(path: str) -> bool:
    return os.path.islink(path) and not os.path.exists(path)


def _limit(directory: str, name: str, default: int) -> int:
    try:
        return os.pathconf(directory, name)
    except (OSError, ValueError, AttributeError):  # no such limit here (or no pathconf): the usual one
        return default


def _check_lengths(path: str, arg: str) -> None:
    """Every name in ``path`` within the filesystem's limit for a name, and the whole path within
    its limit for a path (the OS would refuse it later, with an error that names no argument)."""
    full = os.path.abspath(path)
    ancestor = full
    while not os.path.isdir(ancestor) and os.path.dirname(ancestor) != ancestor:
        ancestor = os.path.dirname(ancestor)
    name_max, path_max = _limit(ancestor, "PC_NAME_MAX", 255), _limit(ancestor, "PC_PATH_MAX", 4096)
    for name in full.split(os.sep):
        size = len(os.fsencode(name))
        if size > name_max:
            raise ValueError(f"{arg} {path!r} cannot be used: the name {name[:32]!r}... in it is {size} bytes long, "
                             f"and this filesystem allows at most {name_max}; choose a shorter {arg}")
    size = len(os.fsencode(full))
    if size >= path_max:
        raise ValueError(f"{arg} {path!r} cannot be used: it is {size} bytes long as an absolute path, and this "
                         f"system allows less than {path_max}; choose a shorter {arg}")


def check_output_dir(path: str, arg: str) -> None:
    """Raise ``ValueError`` naming ``arg`` and ``path`` unless ``path`` is a directory this
    process can write in, or one it can create (its nearest existing ancestor is a writable
    directory). Nothing is created.

    Example:
        >>> import tempfile
        >>> check_output_dir(tempfile.mkdtemp() + "/runs/new", "log_dir")  # creatable: fine
        >>> check_output_dir("/dev/null", "log_dir")
        Traceback (most recent call last):
        ...
        ValueError: log_dir '/dev/null' is a device, not a directory
    """
    _check_lengths(path, arg)
    if _dangling(path):
        raise ValueError(f"{arg} {path!r} is a symbolic link to {os.readlink(path)!r}, which does not exist")
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"{arg} {path!r} is {_kind(path)}, not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{arg} {path!r} is a directory this process cannot write in")
        return
    _check_creatable(path, arg)


def _check_creatable(path: str, arg: str) -> None:
    """``path`` does not exist: its nearest existing ancestor must be a writable directory."""
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(ancestor):
        if _dangling(ancestor):
            raise ValueError(f"{arg} {path!r} cannot be created: {ancestor!r} is a symbolic link to "
                             f"{os.readlink(ancestor)!r}, which does not exist")
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(f"{arg} {path!r} cannot be created: {ancestor!r} is {_kind(ancestor)}, not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{arg} {path!r} cannot be created: this process cannot write in {ancestor!r}")


def check_output_file(path: str, arg: str) -> None:
    """Raise ``ValueError`` naming ``arg`` and ``path`` unless ``path`` is a regular file this
    process can write, or one it can create (with the directories missing on its way)."""
    _check_lengths(path, arg)
    if _dangling(path):
        raise ValueError(f"{arg} {path!r} is a symbolic link to {os.readlink(path)!r}, which does not exist")
    if os.path.exists(path):
        if os.path.isdir(path):
            raise ValueError(f"{arg} {path!r} is a directory, not a file")
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ValueError(f"{arg} {path!r} is {_kind(path)}, not a regular file")
        if not os.access(path, os.W_OK):
            raise ValueError(f"{arg} {path!r} is a file this process cannot write")
        return
    _check_creatable(path, arg)


def new_run_id(taken: Callable[[str], bool]) -> str:
    """A run id for a new run: ``MonDD_HH-MM-SS`` now, with ``_2``, ``_3``... while ``taken(id)``.

    Example:
        >>> first = new_run_id(lambda run_id: False)
        >>> new_run_id(lambda run_id: run_id == first) == first + "_2"
        True
    """
    stamp = time.strftime("%b%d_%H-%M-%S")
    run_id, n = stamp, 1
    while taken(run_id):
        n += 1
        run_id = f"{stamp}_{n}"
    return run_id


def check_run_id(value: Any) -> Optional[str]:
    """``value`` if it is a run id (one plain path component), else None: a state that names a
    path, or anything else, is not obeyed.

    Example:
        >>> check_run_id("Jan05_12-30-45_2"), check_run_id("../elsewhere"), check_run_id("/tmp")
        ('Jan05_12-30-45_2', None, None)
    """
    if isinstance(value, str) and _RUN_ID.fullmatch(value) and value not in (".", ".."):
        return value
    return None


def legacy_run_id(path: Any, run_name: str, suffix: str = "") -> Optional[str]:
    """The run id in the base name of a path saved by an older version (``<run_name>_<id><suffix>``),
    or None. Only the name is used: the file is looked for under the handler's own directory."""
    if not isinstance(path, str) or not path:
        return None
    name = os.path.basename(path.rstrip("/\\"))
    prefix = f"{run_name}_"
    if not name.startswith(prefix) or not name.endswith(suffix):
        return None
    return check_run_id(name[len(prefix):len(name) - len(suffix)] if suffix else name[len(prefix):])
