"""What the commands of ``python -m mha`` share: the error a user can fix and the run of a
command from its parser to its exit status."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable


class CommandError(Exception):
    """A problem the user can fix, reported in one line with exit status 2."""


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None,
                command: Callable[[argparse.Namespace], Any], report: Callable[[Any], None],
                errors: tuple[type[Exception], ...] = (CommandError,)) -> int:
    """Parse ``argv``, run ``command(args)`` and print ``report(result)`` -> the exit status.

    0 on success or ``--help``; 2 on a bad option (argparse prints it) or one of ``errors``
    (printed after the program's name, one line); 130 when interrupted (Ctrl-C)."""
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:                 # --help (0) or a bad option (2, message printed)
        return int(e.code or 0)
    try:
        result = command(args)
    except errors as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    report(result)
    return 0
