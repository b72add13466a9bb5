"""`python -m fedjax_split.flower --config FILE [train flags] --supernodes N --output-dir DIR`,
and for further pre-training `python -m fedjax_split.flower pretrain [pretrain flags] ...`.

A local federation of real processes: a Flower SuperLink and N SuperNodes on 127.0.0.1 (each
given its partition id, or with fewer nodes than clients its block of them, a state directory
under DIR/flower/nodes/ and, with --site-data, its own site's directory as its data-dir, which
only it reads), our ServerApp and ClientApp run on them with `flwr run`, then everything is
stopped. The run directory is the one
`train` writes (config.json, partition.json, metrics.jsonl, summary.json, checkpoints/), plus
DIR/flower/ (the processes' logs and the nodes' local parts). The flags are train's (the same
config schema) plus the federation's own below. `--write-app DIR` only writes the Flower App
(for `flwr run` against SuperNodes on other machines: docs/deployment.md) and exits.

`pretrain` as the first argument runs `python -m fedjax_split.pretrain`'s run (its flags, the
same federation flags) through the apps instead (`deploy.pretrain_server`, `deploy.pretrain_node`):
the run directory `pretrain` writes, equal to it bit for bit but for times.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedjax_split import train
from fedjax_split.cli import parse_flags, run_command
from fedjax_split.deploy import protocol
from fedjax_split.deploy.launch import Federation, link_identical_files, write_app
from fedjax_split.errors import UserError, report
from fedjax_split.pretrain import DESCRIPTION, done_line
from fedjax_split.run import outputs
from fedjax_split.run.config import ExperimentConfig, resolve_config
from fedjax_split.run.pretrain_config import SCHEMA, PretrainConfig, resolve
from fedjax_split.run.settings import DEPLOYMENT, Parser, replaced
from fedjax_split.run.sites import NODE_SITES, site_dirs

Config = ExperimentConfig | PretrainConfig  # what a run of either command is
DEPLOY_FLAGS = ("supernodes", "round_timeout", "connect_timeout", "run_timeout", "write_app")


def build_parser() -> Parser:
    """train's parser (one flag per ExperimentConfig field) plus the federation's flags."""
    p = train.build_parser()
    p.prog = "python -m fedjax_split.flower"
    p.usage = (
        "%(prog)s [--config FILE[:ARG]] [flags, by section below]\n"
        "       %(prog)s pretrain [flags] (its own: %(prog)s pretrain --help)"
    )
    p.description = (
        "Run the federated training as a real Flower federation on this machine: a SuperLink "
        "and one SuperNode per client as separate processes on 127.0.0.1. Writes the run "
        "directory `train` writes. " + (p.description or "")
    )
    return add_deploy_flags(p)


def add_deploy_flags(p: Parser) -> Parser:
    """The federation's own flags (`DEPLOY_FLAGS`), fine-tuning's and pre-training's, in the
    parser's deployment section of --help."""
    group = p.groups[DEPLOYMENT]
    group.add_argument(
        "--supernodes", type=int, metavar="N",
        help="SuperNodes to start (default: --clients, one per client). Fewer (fine-tuning "
        "without --site-data) gives each a block of clients, e.g. partition-ids=0-33.",
    )  # fmt: skip
    group.add_argument(
        "--round-timeout", type=float, metavar="SECONDS",
        help="How long the server waits for a round's replies; a client that does not answer is "
        "left out of the round and recorded in clients_failed (default 600).",
    )  # fmt: skip
    group.add_argument(
        "--connect-timeout", type=float, metavar="SECONDS",
        help="How long the server waits for every SuperNode at the start (default 300).",
    )  # fmt: skip
    group.add_argument(
        "--run-timeout", type=float, metavar="SECONDS",
        help="How long the whole run may take before it is stopped (default: none).",
    )  # fmt: skip
    group.add_argument(
        "--write-app", metavar="DIR",
        help="Only write the Flower App (pyproject.toml with this run's config) to DIR, for "
        "`flwr run DIR` against a SuperLink elsewhere, and exit.",
    )  # fmt: skip
    return p


def parse(argv: Sequence[str] | None) -> tuple[ExperimentConfig, dict[str, Any]]:
    """(ExperimentConfig, the federation's flags) from the command line."""
    file_values, given = parse_flags(build_parser(), argv)
    deploy = {k: given.pop(k) for k in DEPLOY_FLAGS if k in given}
    return resolve_config(file_values, given), deploy


def _absolute(config: Config) -> Config:
    """Paths made absolute: the ServerApp and ClientApps run in other working directories."""
    changes: dict[str, Any] = {"output_dir": str(config.run_dir.absolute())}
    if config.data.data_dir is not None:
        changes["data_dir"] = str(Path(config.data.data_dir).absolute())
    if Path(config.model.name).exists():
        changes["model"] = str(Path(config.model.name).absolute())
    if config.config is not None:
        changes["config"] = str(Path(config.config).absolute())
    sites = site_dirs(config)
    if sites:
        changes["site_data"] = ",".join(str(d.absolute()) for d in sites)
    return replaced(config, **changes)


def run_config(config: Config, deploy: dict[str, Any], status_file: str = "") -> dict[str, Any]:
    """The Flower App's run config for this run. With --site-data the sites' paths stay out of
    it: the run says `node-config`, and each SuperNode is given its own site's directory."""
    if config.data.site_data is not None:
        config = replaced(config, site_data=NODE_SITES)
    stop = os.environ.get("FEDJAX_SPLIT_STOP_AFTER_ROUND", "")

    if isinstance(config, PretrainConfig):  # further pre-training: deploy.pretrain_server
        values: dict[str, Any] = {
            protocol.KIND: protocol.PRETRAIN,
            protocol.PRETRAIN_CONFIG: json.dumps(config.to_dict()),
        }
    else:
        values = {protocol.EXPERIMENT: json.dumps(config.to_dict())}
    values |= {
        protocol.ROUND_TIMEOUT: float(deploy.get("round_timeout") or 600.0),
        protocol.CONNECT_TIMEOUT: float(deploy.get("connect_timeout") or 300.0),
        protocol.STATUS_FILE: status_file,
        protocol.STOP_AFTER_ROUND: int(stop) if stop else 0,
    }
    return values


def node_configs(
    flower_dir: Path, clients: int, supernodes: int, sites: Sequence[Path] | None = None
) -> list[dict[str, Any]]:
    """SuperNode j's node config: its client (`partition-id`), or its block of clients
    (`partition-ids=A-B`) when there are fewer nodes than clients; its state under
    flower_dir/nodes/node_j; with `sites`, site j's directory as its data-dir."""
    out = []
    for j, block in enumerate(node_blocks(clients, supernodes)):
        ids = {protocol.PARTITION_ID: block[0]} if len(block) == 1 else {
            protocol.PARTITION_IDS: f"{block[0]}-{block[-1]}"}  # fmt: skip
        out.append({**ids, protocol.STATE_DIR: str(flower_dir / "nodes" / f"node_{j}"),
                    **({protocol.DATA_DIR: str(sites[j])} if sites else {})})  # fmt: skip
    return out


def _federate(
    run_dir: Path,
    nodes: list[dict[str, Any]],
    values: dict[str, Any],
    deploy: dict[str, Any],
) -> tuple[int, dict[str, Any] | None]:
    """Starts the federation (`nodes`: the SuperNodes' node configs), runs the App whose run
    config is `values` on it, stops every process: (0, the ServerApp's status) when the run
    ended with a result, else (the exit status, None) after saying why."""
    flower_dir = run_dir / "flower"
    with tempfile.TemporaryDirectory(prefix="fedjax_split_app_") as tmp:
        status_path = Path(tmp) / "status.json"
        app = write_app(Path(tmp) / "app", {**values, protocol.STATUS_FILE: str(status_path)})
        # every process of the federation carries the run directory in its environment, so that
        # it can be found (tests check that none outlives the command)
        # (no JAX cache setting of its own: every process applies `runtime.enable_xla_cache`, so
        # the nodes share the simulation's cache and a first run loads what `train` compiled)
        env = {"FEDJAX_SPLIT_FLOWER_RUN": str(run_dir)}
        fed = Federation(nodes, flower_dir / "logs", env=env)
        try:
            fed.start()
            code = fed.submit(app, timeout=deploy.get("run_timeout") or 10**9, echo=sys.stderr)
            log = fed.run_log()
        except UserError as err:
            return report(err), None
        except KeyboardInterrupt:
            print("interrupted; the federation was stopped", file=sys.stderr)
            return 130, None
        finally:
            fed.close()
            # the nodes share this disk: what several of them keep alike is stored once
            link_identical_files(flower_dir / "nodes")
        status = outputs.read_json(status_path) if status_path.is_file() else None
    if status is None or status.get("status") == "crashed":
        why = status["message"] if status else f"`flwr run` ended with status {code}"
        print(f"error: the Flower run ended without a result ({why}); see {log}", file=sys.stderr)
        return 1, None
    if status["status"] == "error":
        return report(UserError(status["message"])), None
    if status["status"] == "stopped":
        print(
            f"interrupted (last checkpoint: round {status['round']}; continue with the same flags "
            f"plus --resume --output-dir {run_dir})",
            file=sys.stderr,
        )
        return 130, None
    return 0, status


def _launch(
    config: Config, deploy: dict[str, Any], supernodes: int
) -> tuple[int, dict[str, Any] | None]:
    """The run of `config` (fine-tuning or pre-training) on a federation of `supernodes` nodes
    on this machine, each given its clients and, with --site-data, its site: `_federate`'s
    (exit status, the ServerApp's status)."""
    clients = config.federation.clients
    nodes = node_configs(config.run_dir / "flower", clients, supernodes, site_dirs(config))
    return _federate(config.run_dir, nodes, run_config(config, deploy), deploy)


def _app_only(config: Config, deploy: dict[str, Any]) -> bool:
    """With --write-app DIR: writes the Flower App there, says so, True (nothing else runs)."""
    if not deploy.get("write_app"):
        return False
    app = Path(deploy["write_app"])
    if (app / "pyproject.toml").exists():
        raise UserError(f"{app / 'pyproject.toml'} exists; pass a new --write-app DIR or remove it")
    try:
        app = write_app(app, run_config(config, deploy))
    except OSError as e:  # a file where the folder would be, no permission, a full disk
        raise UserError(f"cannot write the Flower App to {str(app)!r} ({e.strerror or e}); "
                        "pass --write-app a folder you can write") from None  # fmt: skip
    print(f"wrote the Flower App to {app}; run it with `flwr run {app} <superlink>`")
    return True


def _supernodes(config: Config, deploy: dict[str, Any]) -> int:
    """The SuperNodes to start, the federation's flags checked: one per client, or for
    fine-tuning on one pool (no --site-data) between 1 and --clients, each holding a block."""
    clients = config.federation.clients
    several = isinstance(config, ExperimentConfig) and config.data.site_data is None
    supernodes = clients if deploy.get("supernodes") is None else deploy["supernodes"]
    allowed = 1 <= supernodes <= clients if several else supernodes == clients
    if not allowed:
        raise UserError(
            f"--supernodes {supernodes} but --clients {clients}: "
            + (f"pass 1 to {clients}" if several else
               "this federation runs one client per SuperNode; pass the same number")
        )  # fmt: skip
    for name in ("round_timeout", "connect_timeout", "run_timeout"):
        if deploy.get(name) is not None and not deploy[name] > 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {deploy[name]}")
    return int(supernodes)


def node_blocks(clients: int, supernodes: int) -> list[list[int]]:
    """Clients 0..clients-1 in `supernodes` contiguous blocks, the first ones a client longer."""
    base, extra = divmod(clients, supernodes)
    blocks, start = [], 0
    for j in range(supernodes):
        size = base + (j < extra)
        blocks.append(list(range(start, start + size)))
        start += size
    return blocks


def _checked_run(
    parse_argv: Callable[[Sequence[str]], tuple[Config, dict[str, Any]]], argv: Sequence[str]
) -> tuple[int, dict[str, Any] | None, int]:
    """Either command's run: its flags parsed (`parse` or `parse_pretrain`), the run checked
    before any process starts (`deploy.preflight`: a problem is one line), then run (`_launch`):
    (exit status, the ServerApp's status or None when there is nothing more to say, SuperNodes)."""
    try:
        config, deploy = parse_argv(argv)
        config = _absolute(config)
        supernodes = _supernodes(config, deploy)
        if _app_only(config, deploy):
            return 0, None, 0
        from fedjax_split.deploy import preflight  # the job's modules (JAX): after parsing

        preflight.check(config)
    except UserError as err:
        return report(err), None, 0
    code, status = _launch(config, deploy, supernodes)
    return code, status, supernodes


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["pretrain"]:
        return main_pretrain(argv[1:])
    code, status, supernodes = _checked_run(parse, argv)
    if status is None:
        return code
    summary = status["summary"]
    metric = summary["primary_metric"]
    value = summary["final"].get(metric)
    spread = outputs.spread_words(summary["final"], metric)
    spread = "; " + spread if spread else ""
    figure = (
        f"{metric} not evaluated"
        if value is None
        else f"{metric} {value:.4f} (mean over clients{spread})"
    )
    privacy = outputs.summary_privacy(summary)
    print(
        f"done: {summary['rounds']} rounds on {supernodes} SuperNodes, {figure}; "
        f"{privacy + '; ' if privacy else ''}{summary['cum_bytes'] / 1e6:.1f} MB sent; "
        f"results in {summary['run_dir']}"
    )
    return 0


def parse_pretrain(argv: Sequence[str]) -> tuple[PretrainConfig, dict[str, Any]]:
    """(PretrainConfig, the federation's flags) from `pretrain`'s flags plus the federation's."""
    parser = SCHEMA.build_parser(
        "python -m fedjax_split.flower pretrain",
        "Run federated further pre-training as a real Flower federation on this machine: a "
        "SuperLink and one SuperNode per client on 127.0.0.1, each node reading its own text. "
        "Writes the run directory `pretrain` writes. " + DESCRIPTION,
    )
    file_values, given = parse_flags(add_deploy_flags(parser), argv)
    deploy = {k: given.pop(k) for k in DEPLOY_FLAGS if k in given}
    return resolve(file_values, given), deploy


def main_pretrain(argv: Sequence[str]) -> int:
    """`python -m fedjax_split.flower pretrain [pretrain's flags] [the federation's flags]`:
    further pre-training (FedBFPT, bert-fl, truncated) through the Flower apps, equal to
    `python -m fedjax_split.pretrain` with the same flags."""
    code, status, supernodes = _checked_run(parse_pretrain, argv)
    if status is None:
        return code
    print(done_line(status["summary"]).replace("done: ", f"done on {supernodes} SuperNodes: ", 1))
    return 0


def cli() -> None:
    """`python -m fedjax_split.flower` and `fedjax-split-flower`: train's entry point (the
    federation's ServerApp and ClientApp processes apply `fedjax_split.runtime` themselves)."""
    run_command(main)


if __name__ == "__main__":
    cli()
