"""The command line: `python -m fedjax_split.train --task=sst2 [flags]`.

Thin on purpose: parse flags, resolve the config (defaults <- --config file <- flags given), call
`experiment.run_experiment`. A `UserError` prints `error: <one line>` and exits 2 (no traceback);
Ctrl-C exits 130 and says which checkpoint `--resume` will continue from.
"""

from __future__ import annotations

from collections.abc import Callable

from fedjax_split.cli import RunCommand, run_command
from fedjax_split.run import outputs
from fedjax_split.run.config import SCHEMA, resolve_config

DESCRIPTION = (
    "Federated fine-tuning of a BERT encoder on non-IID clients: FedSplitBERT (split at "
    "--critical-layer; layers above it stay on each client) with any server algorithm. "
    "Defaults are the paper's setting (bert-base-uncased, 3 clients, Table I partition, "
    "critical layer L/2: 6 of bert-base's 12)."
)


def _job() -> Callable[..., dict]:
    """The simulation (`RunCommand.job`)."""
    from fedjax_split.run.experiment import run_experiment

    return run_experiment


def duration(seconds: float) -> str:
    """Seconds as a person says them: "42.1 s", "10 min 3 s", "2 h 5 min"."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    return f"{minutes // 60} h {minutes % 60} min"


def done_line(summary: dict) -> str:
    """The run's last lines: its figure beside what the label priors alone score, with DP the
    epsilon spent (and the budget left), what it sent, how long its rounds took, and where its
    plot and results are and how to export a model; a warning line last when the figure is at or
    below the label priors' (`outputs.below_majority`)."""
    metric, run_dir = summary["primary_metric"], summary["run_dir"]
    value = summary["final"].get(metric)
    if value is None:
        figure = f"{metric} not evaluated (--eval-every 0)"
    else:
        spread = outputs.spread_words(summary["final"], metric)
        figure = f"{metric} {value:.4f} (mean over clients{'; ' + spread if spread else ''})"
        if summary.get("majority_label") is not None:
            figure += f", majority label {summary['majority_label']:.4f}"
    privacy = outputs.summary_privacy(summary)
    if privacy is not None:
        figure += f"; {privacy}"
    plot = f"plot {summary['plot']}, " if summary.get("plot") else ""
    warning = outputs.below_majority(summary)
    return (
        f"done: {summary['rounds']} rounds, {figure}; {summary['cum_bytes'] / 1e6:.1f} MB sent, "
        f"{duration(summary['seconds'])}\n"
        f"  results in {run_dir} ({plot}summary.json, metrics.jsonl); a client's model: "
        f"python -m fedjax_split.export --run-dir {run_dir} --client 0 --out {run_dir}/client0"
        + (f"\n{warning}" if warning else "")
    )


COMMAND = RunCommand(
    "python -m fedjax_split.train", DESCRIPTION, SCHEMA, resolve_config, _job, done_line
)
# the command's parser, its config from flags (--site-data's sites are the clients unless
# --clients is given: `resolve_config`), and the command in-process (an exit status)
build_parser, config_from_args, main = COMMAND.build_parser, COMMAND.config_from_args, COMMAND.main


def cli() -> None:
    """`python -m fedjax_split.train` and `fedjax-split-train`."""
    run_command(main)


if __name__ == "__main__":
    cli()
