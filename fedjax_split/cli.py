"""What every command (train, pretrain, flower, export, assets) does around its run: process
settings first, warnings and errors on one line, Ctrl-C's line, exit statuses (0 done, 2 a user
error, 130 interrupted)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from fedjax_split.errors import UserError, report
from fedjax_split.run.settings import load_config_file

# a command's entry point and its warnings' format live with the process settings (`runtime`), so
# that the lower layers' own entry points (assets, the Flower apps) use them without importing up
from fedjax_split.runtime import one_line_warning, one_line_warnings, run_command

__all__ = ["one_line_warning", "one_line_warnings", "run_command", "run_main"]


def parse_flags(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the --config file's values, the flags given): what a command's `resolve` lays over the
    defaults, the flags last."""
    given = vars(parser.parse_args(argv))
    return (load_config_file(given["config"]) if "config" in given else {}), given


def run_main(
    parse: Callable[[], Any],
    run: Callable[[Any], dict[str, Any]],
    done: Callable[[dict[str, Any]], str],
) -> int:
    """A command's main: `parse()` the config, `run(config)` it, print `done(summary)`; a
    UserError is its one line and exit status 2, Ctrl-C says which checkpoint `--resume`
    continues from (exit status 130)."""
    config = None
    try:
        config = parse()
        summary = run(config)
    except UserError as e:
        return report(e)
    except KeyboardInterrupt:
        from fedjax_split.run import driver  # the checkpoints' reader (JAX): only when needed

        return driver.interrupted(None if config is None else config.run_dir)
    print(done(summary))
    return 0
