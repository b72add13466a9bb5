"""User-facing errors.

Anything a user can cause (bad flag, missing data, corrupt checkpoint) raises `UserError` with one
line that names the problem and the fix; the CLI prints it and exits with status 2, no traceback.
It is an ordinary ValueError, so library users (notebooks, Flower apps) catch it like any other.
What is worth saying but expected (a new task head drawn from the seed) is a `Note`: a warning
category that the commands print as a plain line, without "warning:".
"""

from __future__ import annotations

import sys


class UserError(ValueError):
    """A problem with the user's input or environment, reported as one line, exit status 2."""

    exit_code = 2


class Note(UserWarning):
    """Something expected that a user should still hear of (a new task head drawn from the seed):
    the commands print it as a plain line (`runtime.one_line_warning`), not as a warning. A
    warning category, so that the library itself prints nothing and a caller can filter it."""


def brief(error: BaseException, limit: int = 120) -> str:
    """An exception's text on one line, cut to `limit` characters: the reason a UserError quotes
    from a library's failure (pyarrow's, datasets') without breaking the one-line rule."""
    return " ".join(str(error).split())[:limit]


def report(error: UserError) -> int:
    """Prints `error: <one line>` to stderr, the form every command line here uses, and returns
    the exit status to end with."""
    print(f"error: {error}", file=sys.stderr)
    return error.exit_code
