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

from fedjax_split.run.config import ALGORITHMS, PARTITIONS, QUANTIZE, ExperimentConfig

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

    def add(flag: str, help_: str, **kw: Any) -> None:
        name = flag[2:].replace("-", "_")
        default = getattr(_D, name, None)
        p.add_argument(flag, help=f"{help_} (default: {default})", **kw)

    add(
        "--config",
        "Python (get_config() -> dict) or JSON config file; flags given override it.",
        metavar="FILE",
    )
    add(
        "--task",
        "Task: a GLUE task (cola, sst2, mrpc, qqp, mnli, qnli, rte, wnli, stsb) or an "
        "offline corpus (rotten_tomatoes, 20news, trec).",
    )
    add(
        "--model",
        "Hugging Face model id, local HF-format directory, or the offline alias 'minilm-l6'.",
    )
    add(
        "--data-dir",
        "Directory with the task's local files (GLUE TSV/parquet); unset: the hub "
        "or the offline asset.",
        metavar="DIR",
    )
    add(
        "--algorithm",
        "Server algorithm; FedSplitBERT is any algorithm with --critical-layer < L.",
        choices=None,
        metavar="{" + ",".join(ALGORITHMS) + "}",
    )
    add(
        "--freeze",
        "Regex over Hugging Face tensor names (re.search): matching parameters are frozen, "
        "neither trained nor sent, whatever --critical-layer says; e.g. 'embeddings\\.' or "
        "'embeddings\\.|encoder\\.layer\\.[0-2]\\.'.",
        metavar="REGEX",
    )
    add(
        "--critical-layer",
        "Layers 1..c (and embeddings) are global, the rest local per client; "
        "'L' = all global (plain FedAvg), 0 = no sharing.",
        type=_optional_int,
        metavar="C",
    )
    add("--clients", "Number of clients K.", type=int)
    add(
        "--clients-per-round",
        "Clients sampled each round; 'all' = every client (the paper).",
        type=_optional_int,
        metavar="M",
    )
    add(
        "--partition",
        "How examples are split over clients: the paper's label shares, Dirichlet "
        "label skew, Dirichlet quantity skew, or IID.",
        metavar="{" + ",".join(PARTITIONS) + "}",
    )
    add(
        "--alpha",
        "Dirichlet concentration for --partition dirichlet (small = more skewed).",
        type=float,
    )
    add("--beta", "Dirichlet concentration of client sizes for --partition quantity.", type=float)
    add("--rounds", "Number of federated rounds.", type=int)
    add("--local-epochs", "Epochs each client trains on its data per round.", type=int)
    add("--batch-size", "Client mini-batch size.", type=int)
    add("--lr", "Client AdamW learning rate.", type=float)
    add("--mu", "FedProx proximal weight (used only with --algorithm fedprox).", type=float)
    add(
        "--quantize",
        "Wire dtype of the global weights in both directions (the paper's +16-bit).",
        metavar="{" + ",".join(QUANTIZE) + "}",
    )
    add("--max-length", "Tokens per input after truncation.", type=int)
    add(
        "--max-examples",
        "Subsample the task to this many examples before partitioning (quick runs).",
        type=_optional_int,
        metavar="N",
    )
    add(
        "--seed",
        "The one seed of the run (data subsample, partition, init, batches, dropout).",
        type=int,
    )
    add(
        "--output-dir",
        "Run directory for metrics.jsonl, summary.json, config.json, "
        "partition.json and checkpoints/ (unset: runs/<task>_<algorithm>_c<c>_K<K>_s<seed>).",
        metavar="DIR",
    )
    add(
        "--resume",
        "Continue the run in --output-dir from its latest checkpoint.",
        action="store_const",
        const=True,
    )
    add(
        "--server-lr",
        "Server learning rate (unset: 1.0 for fedavg/fedavgm/fedprox, 1e-3 for the "
        "adaptive rules).",
        type=float,
    )
    add(
        "--eval-every",
        "Evaluate the personalised models every N rounds (and after the last).",
        type=int,
    )
    add(
        "--checkpoint-every",
        "Save a checkpoint every N rounds (and after the last); 0 = never.",
        type=int,
    )
    add(
        "--chunk-size",
        "Train at most this many clients at once (bounds memory); default: one at a time on a CPU, "
        "all at once on an accelerator.",
        type=_optional_int,
    )
    add(
        "--cpu-devices",
        "CPU devices that clients trained one at a time are dealt to, each running its clients "
        "while the others run theirs (default 1). 2 made a 10-client round 10%% faster on 2 cores "
        "but compiles every program once per device (docs/benchmarks.md). Results do not "
        "depend on it.",
        type=_optional_int,
        metavar="N",
    )
    add(
        "--packing",
        "Pack each training batch's examples end to end into one token stream instead of "
        "padding each to the longest: no padding is computed, and batches are plainly "
        "shuffled rather than length-sorted (docs/benchmarks.md).",
        action=argparse.BooleanOptionalAction,
    )
    add(
        "--dtype",
        "Compute dtype of the model (parameters stay float32).",
        metavar="{float32,bfloat16}",
    )
    add(
        "--attention",
        "Attention kernel: xla (default, anywhere) or cudnn (jax's fused cuDNN attention; GPU "
        "with --dtype bfloat16; evaluation only, training keeps xla's).",
        metavar="{xla,cudnn}",
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
    """`python -m fedjax_split.train` and `fedjax-split-train`: `main` in a process on tcmalloc
    where it is installed (fedjax_split.run.malloc), with one-line warnings."""
    import warnings

    from fedjax_split.errors import UserError, report
    from fedjax_split.run import malloc

    try:
        malloc.reexec_with_tcmalloc()
    except UserError as e:
        sys.exit(report(e))
    warnings.formatwarning = _one_line_warning
    sys.exit(main())


if __name__ == "__main__":
    cli()
