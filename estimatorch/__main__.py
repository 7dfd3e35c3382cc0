"""``python -m estimatorch demo``: the main job (see :mod:`estimatorch._demo`)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m estimatorch demo [--epochs N] [--workers N] [--stop-at N] [--model-dir DIR]\n\n"
              "  demo    train a model on generated digit images, stop a second run midway,\n"
              "          resume it from its checkpoint and show it is bit-identical")
        return 0 if argv else 2
    if argv[0] == "demo":
        from ._demo import main as demo

        return demo(argv[1:])
    print(f"unknown command {argv[0]!r}; try: python -m estimatorch demo", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
