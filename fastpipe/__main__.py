"""Command line: ``python -m fastpipe info`` and ``python -m fastpipe demo``."""
from __future__ import annotations

import sys
from typing import List, Optional

USAGE = """usage: python -m fastpipe COMMAND [options]

commands:
  info    versions, native library status, CUDA and Triton availability
  demo    train a small GPT through a pipeline (python -m fastpipe demo --help)
"""


def main(argv: Optional[List[str]] = None) -> int:
    """Dispatch to a sub-command; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "info":
        from .info import format_info
        print(format_info())
        return 0
    if command == "demo":
        from .demo import main as demo
        demo(rest)
        return 0
    print(f"unknown command {command!r}\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
