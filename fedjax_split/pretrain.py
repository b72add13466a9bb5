"""The command line: `python -m fedjax_split.pretrain --corpus pubmed --model minilm-l6
--clients 6 --method fedbfpt --rounds 5 --output-dir DIR`.

Federated further pre-training of BERT with the masked-language-model task: FedBFPT (one layer
and the MLM head trained and sent per round, on small client models) and its baselines (bert-fl,
centralised, truncated, none). Thin on purpose: parse flags (generated from
`run.pretrain_config.PretrainConfig` by `run.settings`), call `run.pretraining.run_pretraining`.
A `UserError` prints `error: <one line>` and exits 2, before anything is written; Ctrl-C exits 130
and says which checkpoint `--resume` continues from. DIR/model is then a Hugging Face
`BertForMaskedLM` that `python -m fedjax_split.train --model DIR/model` fine-tunes.
"""

from __future__ import annotations

from collections.abc import Callable

from fedjax_split.cli import RunCommand, run_command
from fedjax_split.run.pretrain_config import SCHEMA, resolve

DESCRIPTION = (
    "Federated further pre-training (masked LM) of a BERT encoder on text that stays on the "
    "clients: FedBFPT (Wang et al., IJCAI 2023) trains and sends one layer and the MLM head a "
    "round on small client models; baselines bert-fl, centralised, truncated, none. Defaults are "
    "the released FedBFPT setting."
)


def _job() -> Callable[..., dict]:
    """Further pre-training (`RunCommand.job`)."""
    from fedjax_split.run.pretraining import run_pretraining

    return run_pretraining


def done_line(summary: dict) -> str:
    """The command's last line: the run's held-out MLM before and after, bytes, where."""
    initial, final = summary["initial"], summary["final"]
    return (
        f"done: {summary['method']}, {summary['rounds']} rounds, held-out MLM loss "
        f"{initial['mlm_loss']:.4f} -> {final['mlm_loss']:.4f}, accuracy "
        f"{initial['mlm_accuracy']:.4f} -> {final['mlm_accuracy']:.4f}, "
        f"{summary['cum_bytes'] / 1e6:.1f} MB sent; model in {summary['run_dir']}/model"
    )


COMMAND = RunCommand(
    "python -m fedjax_split.pretrain", DESCRIPTION, SCHEMA, resolve, _job, done_line
)
# the command's parser, its config from flags (with --site-data the corpus is local and the sites
# are the clients unless given: `resolve`), and the command in-process (an exit status)
build_parser, config_from_args, main = COMMAND.build_parser, COMMAND.config_from_args, COMMAND.main


def cli() -> None:
    """`python -m fedjax_split.pretrain` and `fedjax-split-pretrain` (train's entry point)."""
    run_command(main)


if __name__ == "__main__":
    cli()
