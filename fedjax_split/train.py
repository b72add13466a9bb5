"""The command line: `python -m fedjax_split.train --task=sst2 [flags]`.

Thin on purpose: parse flags, resolve the config (defaults <- --config file <- flags given), call
`experiment.run_experiment`. A `UserError` prints `error: <one line>` and exits 2 (no traceback);
Ctrl-C exits 130 and says which checkpoint `--resume` will continue from.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from fedjax_split.run.config import FIELDS, ExperimentConfig, nullable, value_type

_D = ExperimentConfig()


def _optional_int(text: str) -> int | None:
    """Integers, with 'none'/'all'/'L' meaning "not set" (all clients, all layers, no limit)."""
    if text.lower() in ("none", "all", "l"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other user error
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m fedjax_split.train",
        description=(
            "Federated fine-tuning of a BERT encoder on non-IID clients: FedSplitBERT (split at "
            "--critical-layer; layers above it stay on each client) with any server algorithm. "
            "Defaults are the paper's setting (bert-base-uncased, 3 clients, Table I partition, "
            "critical layer 6)."
        ),
        argument_default=argparse.SUPPRESS,  # only flags the user gives override the config file
    )

    for name in ["config"] + [n for n in FIELDS if n != "config"]:  # --config first in --help
        meta = FIELDS[name].metadata
        kind = value_type(name)
        kw: dict[str, Any] = {"metavar": meta["metavar"]}
        if meta["choices"]:  # checked by validate(), so that a bad value is a one-line error too
            kw["metavar"] = "{" + ",".join(meta["choices"]) + "}"
        if kind is bool:
            kw = {"action": argparse.BooleanOptionalAction}
        elif kind is int and nullable(name):
            kw["type"] = _optional_int
        elif kind is not str:
            kw["type"] = kind
        default = getattr(_D, name)
        p.add_argument(
            "--" + name.replace("_", "-"), help=f"{meta['help']} (default: {default})", **kw
        )
    return p


def config_from_args(argv: Sequence[str] | None = None) -> ExperimentConfig:
    """Parse flags and resolve them against defaults and the --config file."""
    from fedjax_split.run.config import load_config_file, resolve_config

    given = vars(build_parser().parse_args(argv))
    file_values = load_config_file(given["config"]) if "config" in given else {}
    return resolve_config(file_values, given)


def _interrupt_hook() -> Callable[[int, dict], None] | None:
    """FEDJAX_SPLIT_STOP_AFTER_ROUND=N acts like Ctrl-C right after round N's checkpoint (tests)."""
    value = os.environ.get("FEDJAX_SPLIT_STOP_AFTER_ROUND")
    if not value:
        return None
    stop = int(value)

    def hook(round_: int, record: dict) -> None:
        if round_ == stop:
            raise KeyboardInterrupt

    return hook


def main(argv: Sequence[str] | None = None) -> int:
    from fedjax_split.errors import UserError, report

    config = None
    try:
        config = config_from_args(argv)
        from fedjax_split.run.experiment import run_experiment

        summary = run_experiment(config, progress=True, on_round_end=_interrupt_hook())
    except UserError as e:
        return report(e)
    except KeyboardInterrupt:
        where = "no checkpoint yet"
        if config is not None:
            from fedjax_split.run.checkpoint import RunCheckpointer, checkpoint_dir

            try:
                latest = RunCheckpointer(checkpoint_dir(config.run_dir)).latest_round()
            except UserError:
                latest = None
            if latest is not None:
                where = (
                    f"last checkpoint: round {latest}; continue with the same flags plus "
                    f"--resume --output-dir {config.run_dir}"
                )
        print(f"interrupted ({where})", file=sys.stderr)
        return 130
    metric = summary["primary_metric"]
    print(
        f"done: {summary['rounds']} rounds, final {metric} {summary['final'].get(metric)}, "
        f"{summary['cum_bytes'] / 1e6:.1f} MB sent; results in {summary['run_dir']}"
    )
    return 0


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Warnings as the CLI's other messages, on one line: a source line under them reads like a
    crash. Ours are plain UserWarnings; others keep their category and origin."""
    if category is UserWarning:
        return f"warning: {message}\n"
    return f"warning: {category.__name__}: {message} ({filename}:{lineno})\n"


def cli() -> None:
    """`python -m fedjax_split.train` and `fedjax-split-train`: `main` with one-line warnings (the
    malloc is tuned at import: fedjax_split.run.malloc)."""
    import warnings

    from fedjax_split.errors import UserError, report
    from fedjax_split.run import malloc

    try:
        malloc.check_setting()
    except UserError as e:
        sys.exit(report(e))
    warnings.formatwarning = _one_line_warning
    sys.exit(main())


if __name__ == "__main__":
    cli()
