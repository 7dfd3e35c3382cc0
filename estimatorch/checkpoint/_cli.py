"""``python -m estimatorch.checkpoint``: upgrade older checkpoints in place, or show one."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Optional

import torch

from ._files import atomic_save
from ._format import FORMAT_VERSION, CheckpointError, load, migrate, validate
from ._lock import DirectoryLock, DirectoryLockedError

__all__ = ["main"]


def _migrate_dir(directory: str) -> int:
    upgraded = refused = 0
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not name.endswith(".pt") or not os.path.isfile(path):
            continue
        try:
            raw = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - not a loadable file: report and go on
            print(f"skip {name}: unreadable ({err})")
            continue
        version = raw.get("format_version") if isinstance(raw, dict) else None
        if version == FORMAT_VERSION:
            print(f"ok   {name}: already format {FORMAT_VERSION}")
            continue
        try:
            payload = migrate(raw, source=name)
            validate(payload, source=name)
        except CheckpointError as err:
            print(f"FAIL {name}: {err}")
            refused += 1
            continue
        backup = f"{path}.v{version}"
        if not os.path.exists(backup):
            shutil.copy2(path, backup)
        atomic_save(payload, path)
        print(f"up   {name}: format {version} -> {FORMAT_VERSION} (original kept as {os.path.basename(backup)})")
        upgraded += 1
    print(f"{upgraded} upgraded, {refused} refused")
    return 2 if refused else 0


def _inspect(path: str) -> int:
    payload = load(path)
    first = payload["ranks"][0]
    print(f"{path}: format {payload['format_version']}, estimatorch {payload['estimatorch_version']}, "
          f"torch {payload['torch_version']}, world size {payload['world_size']}")
    print(f"position {first['position']}, plan {first['plan']}")
    print(f"fingerprint {first['fingerprint']}")
    print(f"handlers {sorted(first['handlers'])}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """The command line; returns the exit status (2 on errors)."""
    from . import __doc__ as package_doc

    parser = argparse.ArgumentParser(prog="python -m estimatorch.checkpoint",
                                     description=(package_doc or "").split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_migrate = sub.add_parser("migrate", help="upgrade every older checkpoint in a directory in place "
                                               "(the original is kept as FILE.v<old version>)")
    p_migrate.add_argument("directory")
    p_inspect = sub.add_parser("inspect", help="print what a checkpoint holds")
    p_inspect.add_argument("file")
    args = parser.parse_args(argv)
    try:
        if args.command == "migrate":
            if not os.path.isdir(args.directory):
                parser.error(f"directory {args.directory!r} does not exist")
            lock = DirectoryLock(args.directory)  # never while a fit writes there
            lock.acquire()
            try:
                return _migrate_dir(args.directory)
            finally:
                lock.release()
        return _inspect(args.file)
    except (CheckpointError, DirectoryLockedError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
