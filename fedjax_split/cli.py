"""What every command (train, pretrain, flower, export, assets) does around its run: process
settings first, warnings and errors on one line, Ctrl-C's line, exit statuses (0 done, 2 a user
error, 130 interrupted)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NoReturn


def run_main(
    parse: Callable[[], Any],
    run: Callable[[Any], dict[str, Any]],
    done: Callable[[dict[str, Any]], str],
) -> int:
    """A command's main: `parse()` the config, `run(config)` it, print `done(summary)`; a
    UserError is its one line and exit status 2, Ctrl-C says which checkpoint `--resume`
    continues from (exit status 130)."""
    from fedjax_split.errors import UserError, report
    from fedjax_split.run import driver

    config = None
    try:
        config = parse()
        summary = run(config)
    except UserError as e:
        return report(e)
    except KeyboardInterrupt:
        return driver.interrupted(None if config is None else config.run_dir)
    print(done(summary))
    return 0


def one_line_warning(
    message: Any, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """Warnings as the CLI's other messages, on one line: a source line under them reads like a
    crash. Ours are plain UserWarnings; others keep their category and origin."""
    if category is UserWarning:
        return f"warning: {message}\n"
    return f"warning: {category.__name__}: {message} ({filename}:{lineno})\n"


def one_line_warnings() -> None:
    """This process's warnings through `one_line_warning`: every process entry point (the
    commands, the Flower apps, export, assets, tools/) calls it first; the library alone leaves
    Python's format to the notebook or program that imports it."""
    import warnings

    warnings.formatwarning = one_line_warning


def run_command(command_main: Callable[[], int]) -> NoReturn:
    """A command's entry point: the malloc checked and tuned before anything starts threads (a bad
    setting is the one-line exit-2 error; `fedjax_split.runtime`), warnings on one line, then
    `command_main`'s exit status."""
    from fedjax_split import runtime
    from fedjax_split.errors import UserError, report

    try:
        runtime.check_malloc_setting()
        runtime.tune_malloc()
    except UserError as e:
        sys.exit(report(e))
    one_line_warnings()
    sys.exit(command_main())

