"""deploy.launch's pieces without Flower's processes: the Flower App it writes (parsed back with
tomllib and checked by Flower's own validator), free loopback ports, the processes' environment,
the wait for the SuperLink to listen, and kill_tree over a process tree that spans sessions.
Everything stays on 127.0.0.1 and every process started here is bounded in time."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from run_fixtures import ROOT

from fedjax_split import flower
from fedjax_split.deploy import launch, protocol
from fedjax_split.errors import UserError

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib


def test_free_port_is_a_bindable_loopback_port() -> None:
    ports = {launch.free_port() for _ in range(3)}
    for port in ports:
        assert 1024 <= port <= 65535
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((launch.HOST, port))
            s.listen()


def test_write_app_names_our_apps_and_carries_the_run_config(tmp_path: Path) -> None:
    from flwr.common.config import validate_config

    experiment = {"task": "sst2", "output_dir": "/runs/a \"quoted\" \\ dir", "note": "line\nbreak"}
    run_config = {
        protocol.EXPERIMENT: json.dumps(experiment),
        protocol.ROUND_TIMEOUT: 30.5,
        protocol.CONNECT_TIMEOUT: 60,
        protocol.STATUS_FILE: str(tmp_path / "status.json"),
        protocol.STOP_AFTER_ROUND: 0,
        "flag": True,
    }
    app = launch.write_app(tmp_path / "app" / "nested", run_config)
    assert app == tmp_path / "app" / "nested"
    parsed = tomllib.loads((app / "pyproject.toml").read_text())
    flwr_app = parsed["tool"]["flwr"]["app"]
    assert flwr_app["components"] == {"serverapp": launch.SERVER_APP,
                                      "clientapp": launch.CLIENT_APP}  # fmt: skip
    assert flwr_app["publisher"] == launch.APP_PUBLISHER
    assert flwr_app["config"] == run_config  # types too: float, int, bool, str
    assert json.loads(flwr_app["config"][protocol.EXPERIMENT]) == experiment
    ok, errors, _ = validate_config(parsed, check_module=True, project_dir=app)
    assert ok, errors
    # the components name the apps this package defines
    from fedjax_split.deploy import client_app, server_app

    assert launch.SERVER_APP == f"{server_app.__name__}:app"
    assert launch.CLIENT_APP == f"{client_app.__name__}:app"


def test_process_env_puts_this_interpreter_first_and_keeps_flower_off_the_network(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", "/somewhere/else")
    monkeypatch.delenv("FLWR_TELEMETRY_ENABLED", raising=False)
    monkeypatch.setenv("FLWR_DISABLE_UPDATE_CHECK", "0")  # the user's choice is kept
    env = launch.process_env({"FEDJAX_SPLIT_X": "1", "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "2"})
    assert env["PATH"].split(os.pathsep) == [str(Path(sys.executable).parent), "/somewhere/else"]
    assert env["FLWR_TELEMETRY_ENABLED"] == "0"
    assert env["FLWR_DISABLE_UPDATE_CHECK"] == "0"
    assert env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == "2" and env["FEDJAX_SPLIT_X"] == "1"
    assert launch.process_env()["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == "0.1"
    assert "FEDJAX_SPLIT_X" not in os.environ  # the caller's environment is not touched


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--task=sst3"], "unknown task 'sst3'"),
        (["--round-timeout=-5"], "--round-timeout must be positive"),
        (["pretrain", "--method=fedavg"], "unknown method 'fedavg'"),
        ([], "pyproject.toml exists; pass a new --write-app DIR"),
        (["a file"], "cannot write the Flower App to"),
    ],
)
def test_write_app_checks_the_flags_and_never_overwrites_an_app(
    tmp_path: Path, capsys: pytest.CaptureFixture, flags: list[str], needle: str
) -> None:
    """--write-app only writes the app, but a setting the run would refuse is refused here too,
    and an existing app is left as it was."""
    app = tmp_path / "app"
    if not flags:
        app.mkdir()
        (app / "pyproject.toml").write_text("precious = 1\n")
    if flags == ["a file"]:  # a file where the app's folder would be
        app.write_text("precious = 1\n")
        flags = []
    args = [*flags[:1], "--model=m", f"--data-dir={tmp_path}", f"--write-app={app}", *flags[1:]]
    if flags[:1] == ["pretrain"]:
        args.insert(1, "--corpus=local")
    assert flower.main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    if flags:
        assert not app.exists()
    else:
        kept = app if app.is_file() else app / "pyproject.toml"
        assert kept.read_text() == "precious = 1\n"


def test_write_app_with_a_config_file_carries_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--config FILE` is itself a setting made absolute for the apps (they run elsewhere): the
    flat name `config` must not clash with the function that replaces settings."""
    monkeypatch.chdir(ROOT)
    app = tmp_path / "app"
    assert flower.main(["--config", "configs/offline_rotten_tomatoes.py",
                        f"--write-app={app}"]) == 0  # fmt: skip
    parsed = tomllib.loads((app / "pyproject.toml").read_text())
    run_config = parsed["tool"]["flwr"]["app"]["config"]
    assert str(ROOT / "configs/offline_rotten_tomatoes.py") in json.dumps(run_config)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_kill_tree_kills_children_and_grandchildren_in_other_sessions() -> None:
    """A shell (in its own session, as the launcher starts every process) with two sleeping
    children, one of them detached into a session of its own (as Flower's SuperExec does): all
    have ended when kill_tree returns."""
    script = "sleep 120 & setsid sleep 120 & wait"
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True,
                            stdin=subprocess.DEVNULL)  # fmt: skip
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 20
        while True:  # both sleeps started, and `setsid` has moved one into a session of its own
            tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
            sessions = {os.getsid(pid) for pid in tree}
            if len(tree) == 2 and len(sessions) == 2:
                break
            assert time.monotonic() < deadline, f"the sleeps did not start apart: {sessions}"
            time.sleep(0.05)
        launch.kill_tree(proc)
        assert proc.returncode == -9
        # ended by the time kill_tree returns (it waits): no process of the tree is left
        assert all(_gone(pid) for pid in tree), [p for p in tree if not _gone(p)]
        launch.kill_tree(proc)  # again, on a tree that is gone: nothing to do, no error
    finally:  # whatever survived a failure
        for pid in tree:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_wait_for_the_superlink_ends_in_a_one_line_error(tmp_path: Path) -> None:
    fed = launch.Federation([], tmp_path / "logs", start_timeout=1.0)
    try:
        assert fed.address == f"127.0.0.1:{fed.port}"
        assert fed.env["FLWR_HOME"] == str(fed.home) and fed.home.is_dir()
        exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        exited.wait(timeout=60)
        with pytest.raises(UserError, match="exited at start \\(status 3\\)") as err:
            fed._wait_listening(launch.free_port(), exited, "superlink.log")
        assert "\n" not in str(err.value) and str(tmp_path / "logs") in str(err.value)
        alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            with pytest.raises(UserError, match="did not listen within 1 s"):
                fed._wait_listening(launch.free_port(), alive, "superlink.log")
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((launch.HOST, 0))
                s.listen()
                fed._wait_listening(s.getsockname()[1], alive, "superlink.log")  # returns
        finally:
            alive.kill()
            alive.wait()
    finally:
        fed.close()
    assert not fed.home.exists()  # close removes its Flower home


def test_a_process_log_has_one_clean_line_per_event_its_childrens_too(tmp_path: Path) -> None:
    """The launcher's copy of a process's output: colour codes and Flower's empty records gone,
    and what a child writes after its parent has ended still reaches the log (`close` waits)."""
    script = (
        r"printf '\033[92mINFO \033[0m:      a\n\033[92mINFO \033[0m:      \n';"
        r" (sleep 0.5; echo from the child) &"
    )
    fed = launch.Federation([], tmp_path / "logs")
    try:
        proc = fed._start(["sh", "-c", script], tmp_path / "logs" / "p.log")
        assert proc.wait(timeout=60) == 0
    finally:
        fed.close()
    assert (tmp_path / "logs" / "p.log").read_text() == "INFO :      a\nfrom the child\n"


def test_identical_node_files_become_one_file_and_stay_apart_when_rewritten(
    tmp_path: Path,
) -> None:
    """Three nodes' same global part: one inode, 2 x its bytes freed; a file of the same size
    but other bytes, and other patterns, untouched; a node that later replaces its file (as
    every write does: a new file renamed over the old) changes only its own name."""
    same, other = os.urandom(4096), os.urandom(4096)
    paths = [tmp_path / f"node_{i}" / "run" / "export" / "global_after_2.npz" for i in range(3)]
    for p in paths:
        p.parent.mkdir(parents=True)
        p.write_bytes(same)
    odd = tmp_path / "node_0" / "run" / "client_0" / "round_2.npz"
    odd.parent.mkdir()
    odd.write_bytes(other)
    log = tmp_path / "node_1" / "worker.log"
    log.write_bytes(same)
    assert launch.link_identical_files(tmp_path) == 2 * len(same)
    assert len({p.stat().st_ino for p in paths}) == 1 and paths[0].stat().st_nlink == 3
    assert odd.stat().st_nlink == 1 and log.stat().st_nlink == 1
    assert all(p.read_bytes() == same for p in paths) and odd.read_bytes() == other
    assert launch.link_identical_files(tmp_path) == 0  # nothing left to share
    tmp = paths[1].with_name("new.tmp")
    tmp.write_bytes(other)
    os.replace(tmp, paths[1])
    assert paths[0].read_bytes() == paths[2].read_bytes() == same
    assert launch.link_identical_files(tmp_path / "none") == 0
