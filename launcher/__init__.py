"""`gguf-studio`: the window when no command is given, else the command line.

Sits above both packages so that neither reaches up into the other: `backend` never
imports Qt, and `studio` (the window) is a client of `backend`.
"""

from __future__ import annotations

import sys
from typing import Sequence

__all__ = ["main"]

#: Options that may come without a command and still mean "open the window".
_WINDOW_OPTIONS = frozenset({"-v", "--verbose"})


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if all(arg in _WINDOW_OPTIONS for arg in args):
        from studio.app import main as open_window  # Qt only when the window is wanted

        return open_window()
    from backend.app.cli import main as run_command

    return run_command(args)
