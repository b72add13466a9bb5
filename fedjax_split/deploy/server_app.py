"""The Flower ServerApp: `run_server` over the Grid Flower hands it, configured by the run config.

Run config (the Flower App's `[tool.flwr.app.config]`, written by `python -m fedjax_split.flower`
or by hand for real machines): `experiment` (the resolved ExperimentConfig as JSON: the same
settings as `train`), `round-timeout` and `connect-timeout` (seconds), `status-file` (where the
outcome goes as JSON, for the launcher; empty: nowhere), `stop-after-round` (tests; 0: never).
A user error ends the run with one line `error: ...` in the log (and the status file).
Further pre-training: `kind = "pretrain"` and `pretrain-config` (the resolved PretrainConfig as
JSON: `pretrain`'s settings) instead of `experiment` (`deploy.pretrain_server`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedjax_split import runtime
from fedjax_split.deploy import logs, protocol
from fedjax_split.errors import UserError
from fedjax_split.run import outputs
from fedjax_split.run.config import resolve_config
from fedjax_split.run.pretrain_config import resolve

app = ServerApp()


def _write_status(path: str, status: dict[str, Any]) -> None:
    if path:
        outputs.write_json(Path(path), status)


def _run(grid: Grid, rc: Any) -> dict[str, Any]:
    """The run's outcome for the status file: done (its summary) or stopped after a round. The
    job's modules (JAX) are imported here, after the process settings (`runtime.apply`). Further
    pre-training (run config kind "pretrain"): `deploy.pretrain_server`, its sites' paths (were
    the run config to hold them) replaced by `node-config` as fine-tuning's are, so that the
    server never looks at a site's directory."""
    from fedjax_split.deploy import messaging, pretrain_server, server

    stop = int(rc.get(protocol.STOP_AFTER_ROUND, 0))
    defaults = messaging.DeployOptions
    options = defaults(
        round_timeout=float(rc.get(protocol.ROUND_TIMEOUT, defaults.round_timeout)),
        connect_timeout=float(rc.get(protocol.CONNECT_TIMEOUT, defaults.connect_timeout)),
        stop_after_round=stop or None,
    )
    try:
        if str(rc.get(protocol.KIND, "")) == protocol.PRETRAIN:
            values = protocol.experiment_values(rc, protocol.PRETRAIN_CONFIG)
            summary = pretrain_server.run_pretrain_server(grid, resolve(overrides=values), options)
        else:
            config = resolve_config(overrides=protocol.experiment_values(rc))
            summary = server.run_server(grid, config, options)
    except messaging.Stopped as stopped:
        return {"status": "stopped", "round": stopped.round}
    return {"status": "done", "summary": summary}


@app.main()
def main(grid: Grid, context: Context) -> None:
    logs.app_process()
    rc = context.run_config
    status_file = str(rc.get(protocol.STATUS_FILE, ""))
    try:
        runtime.apply()
        status = _run(grid, rc)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        _write_status(status_file, {"status": "error", "message": str(err)})
        return
    except BaseException as err:
        _write_status(status_file, {"status": "crashed", "message": f"{type(err).__name__}: {err}"})
        raise
    _write_status(status_file, status)
