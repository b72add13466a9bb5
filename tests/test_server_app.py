"""deploy.server_app's main with stand-in Grids: the run config it reads, and the outcome it
writes to the status file (error / stopped / crashed / done) and prints, for the launcher.

No Flower process is started: a Grid here either fails on purpose or delivers each message to
the ClientApp in this process (as a SuperLink and SuperNodes would, minus the network). The
bitwise comparison with the simulation through real processes is tests/test_flower.py's."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from flwr.app import Context, Message, Metadata, RecordDict
from run_fixtures import private_cache, write_tiny_model, write_tiny_sst2  # noqa: F401 (autouse)

from fedjax_split.deploy import messaging, protocol, server, server_app
from fedjax_split.run import outputs


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    base = tmp_path_factory.mktemp("server_app")
    return SimpleNamespace(base=base, model=write_tiny_model(base / "model"),
                           data=write_tiny_sst2(base / "data"))  # fmt: skip


def _experiment(files: SimpleNamespace, out: Path, **extra: object) -> dict:
    from fedjax_split.run.config import resolve_config

    return resolve_config(overrides={
        "task": "sst2", "model": str(files.model), "data_dir": str(files.data),
        "output_dir": str(out), "clients": 3, "critical_layer": 1, "rounds": 1,
        "local_epochs": 1, "batch_size": 32, "lr": 1e-3, "max_length": 16, "seed": 0, **extra,
    }).to_dict()  # fmt: skip


def _context(run_config: dict, node_config: dict | None = None) -> Context:
    return Context(run_id=1, node_id=0, node_config=dict(node_config or {}), state=RecordDict(),
                   run_config=run_config)  # fmt: skip


def _status(path: Path) -> dict:
    return json.loads(path.read_text())


class NoGrid:
    """A Grid no SuperNode ever connects to; counts how often it was asked."""

    def __init__(self) -> None:
        self.asked = 0

    def get_node_ids(self) -> list[int]:
        self.asked += 1
        return []


def test_a_bad_config_ends_with_one_error_line_and_the_status_error(
    files: SimpleNamespace, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    status = tmp_path / "status.json"
    experiment = {**_experiment(files, tmp_path / "run"), "task": "nope"}
    grid = NoGrid()
    run_config = {protocol.EXPERIMENT: json.dumps(experiment), protocol.STATUS_FILE: str(status)}
    assert server_app.main(grid, _context(run_config)) is None
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "unknown task" in lines[0]
    got = _status(status)
    assert got["status"] == "error" and "unknown task" in got["message"]
    assert grid.asked == 0 and not (tmp_path / "run").exists()  # nothing started


def test_the_connect_timeout_comes_from_the_run_config(
    files: SimpleNamespace, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """No SuperNode within `connect-timeout`: a one-line error naming what to start."""
    status = tmp_path / "status.json"
    run_config = {
        protocol.EXPERIMENT: json.dumps(_experiment(files, tmp_path / "run")),
        protocol.CONNECT_TIMEOUT: 0.3, protocol.STATUS_FILE: str(status),
    }  # fmt: skip
    t0 = time.monotonic()
    server_app.main(NoGrid(), _context(run_config))
    assert time.monotonic() - t0 < 60  # not the default 300 s
    got = _status(status)
    assert got["status"] == "error" and "did not connect within 0.3 s" in got["message"]
    assert "partition-id" in got["message"]
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: {got['message']}"


def test_an_empty_status_file_writes_nothing(
    files: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    run_config = {protocol.EXPERIMENT: json.dumps({"task": "nope"}), protocol.STATUS_FILE: ""}
    server_app.main(NoGrid(), _context(run_config))
    assert list(tmp_path.iterdir()) == []


def test_the_run_configs_options_reach_the_server_and_a_stop_is_reported(
    files: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[messaging.DeployOptions] = []

    def stops(grid: Any, config: Any, options: messaging.DeployOptions) -> dict:
        seen.append(options)
        raise messaging.Stopped(2)

    monkeypatch.setattr(server, "run_server", stops)
    status = tmp_path / "status.json"
    experiment = json.dumps(_experiment(files, tmp_path / "run"))
    run_config = {
        protocol.EXPERIMENT: experiment, protocol.ROUND_TIMEOUT: 12.5,
        protocol.CONNECT_TIMEOUT: 7, protocol.STOP_AFTER_ROUND: 2,
        protocol.STATUS_FILE: str(status),
    }  # fmt: skip
    server_app.main(NoGrid(), _context(run_config))
    assert _status(status) == {"status": "stopped", "round": 2}
    assert (seen[0].round_timeout, seen[0].connect_timeout, seen[0].stop_after_round) == (
        12.5, 7.0, 2)  # fmt: skip
    # absent keys: the defaults; stop-after-round 0: never
    server_app.main(NoGrid(), _context({protocol.EXPERIMENT: experiment,
                                        protocol.STOP_AFTER_ROUND: 0}))  # fmt: skip
    defaults = messaging.DeployOptions()
    assert (seen[1].round_timeout, seen[1].connect_timeout, seen[1].stop_after_round) == (
        defaults.round_timeout, defaults.connect_timeout, None)  # fmt: skip


def test_a_crash_is_recorded_and_raised(
    files: SimpleNamespace, tmp_path: Path
) -> None:
    class BrokenGrid:
        def get_node_ids(self) -> list[int]:
            raise RuntimeError("the SuperLink went away")

    status = tmp_path / "status.json"
    run_config = {protocol.EXPERIMENT: json.dumps(_experiment(files, tmp_path / "run")),
                  protocol.STATUS_FILE: str(status)}  # fmt: skip
    with pytest.raises(RuntimeError, match="went away"):
        server_app.main(BrokenGrid(), _context(run_config))
    assert _status(status) == {"status": "crashed",
                               "message": "RuntimeError: the SuperLink went away"}  # fmt: skip


class LoopbackGrid:
    """Delivers each message to the ClientApp of its node in this process, as the SuperLink does:
    with a message id of its own, the reply pulled by that id."""

    def __init__(self, node_contexts: dict[int, Context]) -> None:
        self.contexts = node_contexts
        self.replies: dict[str, Message] = {}
        self.kinds: list[str] = []

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: list[Message]) -> list[str]:
        from fedjax_split.deploy import client_app

        ids = []
        for msg in messages:
            md = msg.metadata
            delivered = Message(msg.content, metadata=Metadata(
                run_id=1, message_id=uuid.uuid4().hex, src_node_id=0, dst_node_id=md.dst_node_id,
                reply_to_message_id="", group_id=md.group_id, created_at=time.time(),
                ttl=md.ttl, message_type=md.message_type,
            ))  # fmt: skip
            self.kinds.append(md.message_type)
            reply = client_app.app(delivered, self.contexts[md.dst_node_id])
            self.replies[delivered.metadata.message_id] = reply
            ids.append(delivered.metadata.message_id)
        return ids

    def pull_messages(self, ids: list[str]) -> list[Message]:
        return [self.replies.pop(i) for i in ids if i in self.replies]


def test_a_whole_round_over_an_in_process_federation_is_done(
    files: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One round of 3 clients: the status says done with the summary the run wrote, and the
    run directory holds what `train` writes."""
    from flwr.supercore.task_identity import TaskIdentity

    # the ServerApp's process identity, which Flower sets before it runs main
    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)
    out = tmp_path / "run"
    experiment = json.dumps(_experiment(files, out))
    nodes = {100 + i: _context({protocol.EXPERIMENT: experiment},
                               {protocol.PARTITION_ID: i,
                                protocol.STATE_DIR: str(tmp_path / f"node_{i}")})
             for i in range(3)}  # fmt: skip
    grid = LoopbackGrid(nodes)
    status = tmp_path / "status.json"
    run_config = {protocol.EXPERIMENT: experiment, protocol.STATUS_FILE: str(status),
                  protocol.ROUND_TIMEOUT: 60}  # fmt: skip
    server_app.main(grid, _context(run_config))
    got = _status(status)
    assert got["status"] == "done", got
    summary = got["summary"]
    assert summary["deploy"] == "flower" and summary["rounds"] == 1 and summary["supernodes"] == 3
    written = json.loads((out / "summary.json").read_text())
    assert written["final"] == outputs.readable(summary)["final"]  # rounded for reading
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (record,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["clients_failed"] == [] and record["eval_failed"] == []
    assert sorted(record["clients_sampled"]) == [0, 1, 2] and len(record["clients"]) == 3
    assert grid.kinds == [protocol.QUERY] * 3 + [protocol.TRAIN] * 3 + [protocol.EVALUATE] * 3
    assert not grid.replies  # every reply was pulled
    for i in range(3):  # each node kept its own local part
        assert len(list((tmp_path / f"node_{i}").rglob(f"client_{i}/round_1.npz"))) == 1


def test_a_pretrain_run_config_with_the_sites_paths_never_makes_the_server_look_at_them(
    files: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Further pre-training's ServerApp sees the sites as `node-config`, as fine-tuning's does:
    the sites' paths left in a run config are none of the server's business (here they do not
    exist on the server's machine, which is no error)."""
    from fedjax_split.deploy import pretrain_server
    from fedjax_split.run.pretrain_config import resolve
    from fedjax_split.run.sites import NODE_SITES

    seen: list[Any] = []
    monkeypatch.setattr(pretrain_server, "run_pretrain_server",
                        lambda grid, config, options: seen.append(config) or {"ok": 1})  # fmt: skip
    sites = [tmp_path / "site_0", tmp_path / "site_1"]
    for d in sites:
        d.mkdir()
    values = resolve(overrides={"site_data": ",".join(map(str, sites)), "model": str(files.model),
                                "output_dir": str(tmp_path / "run")}).to_dict()  # fmt: skip
    for d in sites:
        d.rmdir()  # the server's machine has no such directories
    status = tmp_path / "status.json"
    run_config = {protocol.KIND: protocol.PRETRAIN, protocol.PRETRAIN_CONFIG: json.dumps(values),
                  protocol.STATUS_FILE: str(status)}  # fmt: skip
    server_app.main(NoGrid(), _context(run_config))
    assert _status(status) == {"status": "done", "summary": {"ok": 1}}
    assert seen[0].data.site_data == NODE_SITES and seen[0].federation.clients == 2
