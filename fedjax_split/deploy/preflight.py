"""What `python -m fedjax_split.flower` checks before it starts any process: the run's settings
as the simulation checks them (`run.pieces.check`, `run.safeguards.check_deployable`; for
further pre-training `run.pretrain_setup.check` and `deploy.pretrain_node.check_deployable`), its
run directory (`run.driver.check_run_dir`), and with --site-data every site's files read as its
SuperNode will read them. A problem is one line before anything is written. These checks import
the job's modules (JAX); the command imports this module only after parsing its flags."""

from __future__ import annotations

from fedjax_split.deploy.pretrain_node import check_deployable
from fedjax_split.errors import UserError
from fedjax_split.run import (
    client_data,
    driver,
    pieces,
    pretrain_setup,
    pretraining,
    safeguards,
    saved_config,
)
from fedjax_split.run.config import ExperimentConfig
from fedjax_split.run.pretrain_config import PretrainConfig
from fedjax_split.run.pretrain_text import site_documents
from fedjax_split.run.sites import site_dirs
from fedjax_split.tasks.registry import get_task


def check(config: ExperimentConfig | PretrainConfig) -> None:
    """The run's checks by its kind: fine-tuning's or further pre-training's."""
    if isinstance(config, PretrainConfig):
        check_pretraining(config)
    else:
        check_experiment(config)


def check_experiment(config: ExperimentConfig) -> None:
    """A fine-tuning run's settings, run directory and sites."""
    pieces.check(config)
    safeguards.check_deployable(config)
    saved_config.check_run_dir(config)  # before anything is written
    check_sites(config)


def check_pretraining(config: PretrainConfig) -> None:
    """A further pre-training run's settings, run directory and sites."""
    pretrain_setup.check(config)
    check_deployable(config)
    driver.check_run_dir(config.run_dir, config.outputs.resume,  # before anything is written
                         lambda saved: pretraining.mismatch(saved, config),
                         output_names=["model"])  # fmt: skip
    check_sites(config)


def check_sites(config: ExperimentConfig | PretrainConfig) -> None:
    """With --site-data, each site's files read as its SuperNode will read them (pre-training:
    its *.txt, its held-out documents drawn), so that a bad file is one line before any process
    starts (the local federation's sites are all here)."""
    if config.data.site_data is not None and not site_dirs(config):
        raise UserError(
            f"--site-data {config.data.site_data} is for `--write-app` (real sites, each SuperNode "
            "with its own data-dir); this local federation needs the sites' directories "
            "DIR0,DIR1,..."
        )
    if isinstance(config, PretrainConfig):
        for k, d in enumerate(site_dirs(config)):
            site_documents(config, k, d)
        return
    task = get_task(config.data.task)
    for k, d in enumerate(site_dirs(config)):
        client_data.site_split(config, client_data.load_site(config, task, k, d), k, d)
