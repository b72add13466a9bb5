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

from collections.abc import Sequence

from fedjax_split.cli import parse_flags, run_command, run_main
from fedjax_split.run.pretrain_config import SCHEMA, PretrainConfig, resolve
from fedjax_split.run.settings import Parser

DESCRIPTION = (
    "Federated further pre-training (masked LM) of a BERT encoder on text that stays on the "
    "clients: FedBFPT (Wang et al., IJCAI 2023) trains and sends one layer and the MLM head a "
    "round on small client models; baselines bert-fl, centralised, truncated, none. Defaults are "
    "the released FedBFPT setting."
)


def build_parser() -> Parser:
    """One flag per PretrainConfig setting."""
    return SCHEMA.build_parser("python -m fedjax_split.pretrain", DESCRIPTION)


def config_from_args(argv: Sequence[str] | None = None) -> PretrainConfig:
    """Parse flags and resolve them against defaults and the --config file, then validate
    (`resolve`: with --site-data the corpus is local and the sites are the clients unless
    given)."""
    return resolve(*parse_flags(build_parser(), argv))


def main(argv: Sequence[str] | None = None) -> int:
    """The command in-process (Python, notebooks, tests): its exit status."""
    return run_main(lambda: config_from_args(argv), _run, done_line)


def _run(config: PretrainConfig) -> dict:
    """The job. Its modules (JAX, the model, the data) are imported here, once the flags are
    parsed, so that --help and a flag's error stay fast."""
    from fedjax_split.run import driver, pretraining

    stop = driver.stop_hook_from_env()
    return pretraining.run_pretraining(config, progress=True, on_round_end=stop)


def done_line(summary: dict) -> str:
    """The command's last line: the run's held-out MLM before and after, bytes, where."""
    initial, final = summary["initial"], summary["final"]
    return (
        f"done: {summary['method']}, {summary['rounds']} rounds, held-out MLM loss "
        f"{initial['mlm_loss']:.4f} -> {final['mlm_loss']:.4f}, accuracy "
        f"{initial['mlm_accuracy']:.4f} -> {final['mlm_accuracy']:.4f}, "
        f"{summary['cum_bytes'] / 1e6:.1f} MB sent; model in {summary['run_dir']}/model"
    )


def cli() -> None:
    """`python -m fedjax_split.pretrain` and `fedjax-split-pretrain` (train's entry point)."""
    run_command(main)


if __name__ == "__main__":
    cli()
