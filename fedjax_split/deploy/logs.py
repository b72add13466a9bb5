"""One line per event in a federation's output: in the processes Flower starts for our apps, and
in the log files the launcher writes.

Flower's logger ("flwr") prints through its own handler, in colour whatever the stream; an app
process also has a root handler (absl, under orbax, calls `logging.basicConfig` when it first
logs), so each Flower record printed twice there, once in Python's default format. Flower also
prints empty records as separators. The apps stop the propagation; the launcher's copies drop
colour codes and the empty separators.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import IO, TextIO

from fedjax_split.runtime import one_line_warnings

_ANSI = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]")  # CSI sequences: colours, resets
_EMPTY_RECORD = re.compile(rb"(DEBUG|INFO|WARNING|ERROR|CRITICAL) *: *\r?\n?")


def clean(line: bytes) -> bytes | None:
    """`line` without colour codes; None for a Flower record with no message."""
    plain = _ANSI.sub(b"", line)
    return None if _EMPTY_RECORD.fullmatch(plain) else plain


def copy_lines(source: IO[bytes], log_path: Path, echo: TextIO | None = None) -> None:
    """Every line of `source` until its end, cleaned, appended to `log_path` (flushed line by
    line, so a killed federation leaves its log) and written to `echo` when given (but a line
    `error: ...`, which the command says once itself)."""
    with open(log_path, "ab") as log:
        for raw in iter(source.readline, b""):
            line = clean(raw)
            if line is None:
                continue
            log.write(line)
            log.flush()
            # the app's own `error: ...` line: the command reports it from the status file
            if echo is not None and not line.startswith(b"error: "):
                echo.write(line.decode("utf-8", "replace"))
                echo.flush()


def app_process() -> None:
    """The settings of a process Flower starts to run our ServerApp or ClientApp: warnings on
    one line, Flower's records printed once (by its own handler), in colour only on a terminal."""
    import logging

    from flwr.common.logger import LOGGER_NAME, update_console_handler

    one_line_warnings()
    logging.getLogger(LOGGER_NAME).propagate = False
    update_console_handler(colored=sys.stdout.isatty())
