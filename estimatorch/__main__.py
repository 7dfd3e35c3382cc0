"""``python -m estimatorch COMMAND``: the package's command line (``--help`` lists the commands)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional

from ._demo import DESCRIPTION as _DEMO
from ._demo import main as demo
from ._shadow import shadow_message, shadowing_folder


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m estimatorch", description="estimatorch's command line.",
        epilog="Checkpoint files have their own commands: python -m estimatorch.checkpoint "
               "{inspect,migrate} --help. Each command takes --help.")
    commands = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    commands.add_parser("demo", help=_DEMO)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m estimatorch``: run the command ``argv`` names (``sys.argv`` by default); the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    shadow = shadowing_folder(os.getcwd())
    if shadow is not None:  # where scripts beside it will fail to import the package: say why now
        logging.getLogger("estimatorch").warning(shadow_message(shadow))
    if argv and argv[0] == "demo":
        return demo(argv[1:])
    parser = _parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    parser.parse_args(argv)  # --help prints the commands and exits; anything else is an error
    return 2


if __name__ == "__main__":
    sys.exit(main())
