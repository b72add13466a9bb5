"""deploy.worker: a node's warm worker answers the ClientApp's messages as the ClientApp itself
would, bit for bit; a handler's error comes back as its class; bad frames are refused; the worker
ends with the process it watches, on `stop`, and only one starts for two messages at once.

The handlers are called through the ClientApp, in this process (as tests/test_client_app.py
does), with the worker on for one node and off for another."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import test_client_app
from run_fixtures import private_cache  # noqa: F401 (autouse)
from test_client_app import _context, _message, _round_message

from fedjax_split.deploy import client_app, codec, frames, protocol, worker
from fedjax_split.errors import UserError

fed = test_client_app.fed  # the module's fixture: a tiny 3-client config and round 1's message


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A node state dir whose worker (started by the first message) ends with the module."""
    state_dir = tmp_path_factory.mktemp("warm_node")
    yield state_dir
    worker.stop(state_dir)


def _worker_pid(state_dir: Path) -> int:
    return int(Path(f"{worker.socket_path(state_dir)}.pid").read_text())


def _exchange(fed: SimpleNamespace, state_dir: Path) -> list:
    """A query, round 1's train and its evaluation, as the server sends them."""
    ctx = _context(fed, state_dir)
    return [client_app.app(_message(protocol.QUERY, {}), ctx),
            client_app.app(_round_message(fed, protocol.TRAIN), ctx),
            client_app.app(_round_message(fed, protocol.EVALUATE), ctx)]  # fmt: skip


def _content(reply) -> dict:
    c = reply.content
    out = {f"config/{k}": dict(r) for k, r in c.config_records.items()}
    out |= {f"metrics/{k}": dict(r) for k, r in c.metric_records.items()}
    for name, record in c.array_records.items():
        for path, array in codec.from_record(record).items():
            out[f"{name}/{path}"] = (array.dtype.str, array.shape, array.tobytes())
    return out


def test_replies_through_the_worker_are_the_clientapps_own(
    fed: SimpleNamespace, warm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(worker.ENV, "0")
    here = _exchange(fed, tmp_path / "cold")
    monkeypatch.setenv(worker.ENV, "1")
    through = _exchange(fed, warm)
    for a, b in zip(here, through, strict=True):
        assert b.metadata.message_type == a.metadata.message_type
        assert b.metadata.reply_to_message_id == a.metadata.reply_to_message_id
        assert _content(b) == _content(a)
    assert any(k.startswith("upload/") for k in _content(through[1]))
    pid = _worker_pid(warm)
    assert pid != os.getpid()
    _exchange(fed, warm)  # the same worker answers again
    assert _worker_pid(warm) == pid
    assert not (tmp_path / "cold" / "worker.log").exists()


def test_the_workers_log_says_what_each_message_cost(capsys: pytest.CaptureFixture) -> None:
    """`logged` handlers answer as the handlers do (an error is still raised) and each writes one
    line: the kind, its seconds, the programs compiled for it and those loaded from the cache."""
    import jax
    import jax.numpy as jnp

    def compiles(msg: object, context: object) -> object:
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(msg))  # a program no other test builds
        return "reply"

    def fails(msg: object, context: object) -> object:
        raise ValueError("bad message")

    handlers = worker.logged({protocol.TRAIN: compiles, protocol.EVALUATE: fails})
    assert handlers[protocol.TRAIN](7, None) == "reply"
    with pytest.raises(ValueError, match="bad message"):
        handlers[protocol.EVALUATE](None, None)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[1].startswith("worker: evaluate in ")
    train = re.fullmatch(r"worker: train in \d+\.\d\d s; (\d+) programs compiled \(\d+\.\d s\), "
                         r"(\d+) loaded from the cache", lines[0])  # fmt: skip
    assert train and int(train[1]) + int(train[2]) >= 1, lines[0]
    assert lines[1].endswith("0 programs compiled (0.0 s), 0 loaded from the cache")


def test_a_handlers_error_comes_back_as_its_class_and_bad_frames_are_refused(
    fed: SimpleNamespace, warm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(worker.ENV, "1")
    with pytest.raises(UserError, match="partition-id 3 is outside 0..2"):
        client_app.app(_message(protocol.QUERY, {}), _context(fed, warm, client=3))
    with pytest.raises(ValueError, match="message for client 2 reached 1"):
        client_app.app(_round_message(fed, protocol.TRAIN, client=2), _context(fed, warm))
    path = worker.socket_path(warm)
    for parts in ([b"bogus", b"x", b"y"], [b"query", b"not a protobuf", b"\xff"], [b"query"]):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(path))
            frames.send_parts(conn, parts)
            status, text = frames.recv_parts(conn)
        assert status == b"error" and text, parts
    from flwr.common import serde

    ctx = serde.context_to_proto(_context(fed, warm)).SerializeToString()
    skeleton, raw_index, *arrays = frames.message_parts(_round_message(fed, protocol.TRAIN))
    assert arrays  # the global part's arrays travel beside the protobuf
    index = json.loads(raw_index)
    for bad, needle in (
        ([*arrays, b"one more"], "do not match its index"),
        (arrays[:-1], "do not match its index"),
    ):
        parts = [b"train", ctx, skeleton, json.dumps(index).encode(), *bad]
        assert needle in _refusal(path, parts)
    for entry, needle in (
        ([protocol.GLOBAL, "x", "<f4", [2, "2"], "numpy.ndarray"], "malformed entry"),
        ([protocol.CONFIG, *index[0][1:]], "which is no ArrayRecord"),  # into a ConfigRecord
    ):
        parts = [b"train", ctx, skeleton, json.dumps([entry, *index[1:]]).encode(), *arrays]
        assert needle in _refusal(path, parts)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:  # a frame announcing 2^32-1
        conn.connect(str(path))
        conn.sendall(b"\xff\xff\xff\xff")
        assert conn.recv(16) == b""  # dropped
    reply = client_app.app(_message(protocol.QUERY, {}), _context(fed, warm))
    assert list(reply.content[protocol.CONFIG][protocol.CLIENTS]) == [1]  # the worker goes on
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def _refusal(path: Path, parts: list[bytes]) -> str:
    """The worker's error text for the request frame `parts` (it must refuse it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(path))
        frames.send_parts(conn, parts)
        status, text = frames.recv_parts(conn)
    assert status == b"error", parts[:2]
    return text.decode()


def test_two_messages_at_once_start_one_worker_which_stop_ends(
    fed: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(worker.ENV, "1")
    ctx = _context(fed, tmp_path)
    replies: list = []
    threads = [threading.Thread(target=lambda: replies.append(
        client_app.app(_message(protocol.QUERY, {}), ctx))) for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(replies) == 2
    log = (tmp_path / "worker.log").read_text()
    pid = _worker_pid(tmp_path)
    workers = [line for line in _processes() if f"--socket {worker.socket_path(tmp_path)}" in line]
    assert len(workers) == 1, (workers, log)
    worker.stop(tmp_path)
    _wait_gone(pid)
    assert not worker.socket_path(tmp_path).exists()


@pytest.fixture
def short_tmp(monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary directory with a short path (a Unix socket's path has at most 107 bytes)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="fjw", dir="/tmp"))
    monkeypatch.setattr(worker.tempfile, "tempdir", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_the_worker_ends_with_the_process_it_watches(short_tmp: Path, tmp_path: Path) -> None:
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    path = worker.socket_path(tmp_path / "node")
    proc = subprocess.Popen([sys.executable, "-m", "fedjax_split.deploy.worker", "--socket",
                             str(path), "--watch-pid", str(watched.pid)])  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not path.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        watched.send_signal(signal.SIGKILL)
        watched.wait()
        assert proc.wait(timeout=10) == 0
        assert not path.exists() and not Path(f"{path}.pid").exists()
    finally:
        for p in (watched, proc):
            if p.poll() is None:
                p.kill()


def test_the_sockets_directory_must_be_this_users_alone(short_tmp: Path, tmp_path: Path) -> None:
    base = short_tmp / f"fedjax_split-workers-{os.getuid()}"
    base.mkdir(mode=0o777)
    base.chmod(0o777)
    with pytest.raises(UserError, match="is not this user's alone"):
        worker.socket_path(tmp_path / "node")
    base.chmod(0o700)
    assert len(str(worker.socket_path(tmp_path / ("n" * 200)))) < len(str(short_tmp)) + 80


def test_the_node_config_or_the_environment_turns_the_worker_off(monkeypatch) -> None:
    monkeypatch.delenv(worker.ENV, raising=False)
    assert worker.enabled({})
    assert not worker.enabled({worker.NODE_CONFIG_KEY: False})
    assert not worker.enabled({worker.NODE_CONFIG_KEY: "false"})
    monkeypatch.setenv(worker.ENV, "0")
    assert not worker.enabled({}) and worker.enabled({worker.NODE_CONFIG_KEY: True})


def _processes() -> list[str]:
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        found.append(" ".join(p.info["cmdline"] or []))
    return found


def _wait_gone(pid: int, seconds: float = 10) -> None:
    """Until `pid` has ended (a zombie has: this process, which started it, has not reaped it)."""
    import psutil

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs")


def test_the_clientapp_process_imports_no_jax() -> None:
    """The ClientApp process imports Flower and this package's thin modules only: no JAX."""
    code = ("import sys, fedjax_split.deploy.client_app; "
            "print(json.dumps(['jax' in sys.modules, 'transformers' in sys.modules]))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert json.loads(out) == [False, False]


def test_stop_never_kills_a_process_that_is_not_that_nodes_worker(short_tmp: Path) -> None:
    """A pid file left by a killed worker may name a pid reused by another process: stop checks
    the process's command line first."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        node = short_tmp / "node"
        Path(f"{worker.socket_path(node)}.pid").write_text(str(other.pid))
        worker.stop(node)
        time.sleep(0.2)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_stop_ends_a_worker_that_has_not_written_its_pid_file_and_waits_for_it(
        short_tmp: Path) -> None:
    """A worker just started (no pid file yet: the launcher may stop a node as a message starts
    its worker) is found by its command line, and stop returns once it has ended."""
    path = worker.socket_path(short_tmp / "node")
    proc = subprocess.Popen([sys.executable, "-m", "fedjax_split.deploy.worker", "--socket",
                             str(path)])  # fmt: skip
    try:
        assert not Path(f"{path}.pid").exists()
        worker.stop(short_tmp / "node")
        assert proc.poll() == -signal.SIGKILL  # ended before stop returned (a zombie till now)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class _Execing:
    """A stand-in for psutil's process caught mid-exec: an empty command line for its first
    `empty_reads` reads, then `cmdline`."""

    def __init__(self, pid: int, cmdline: list[str], empty_reads: int, ppid: int = 1) -> None:
        self.pid, self._cmdline, self._left = pid, cmdline, empty_reads
        self.info = {"cmdline": self.cmdline(), "status": "running", "ppid": ppid}

    def cmdline(self) -> list[str]:
        self._left -= 1
        return [] if self._left >= 0 else self._cmdline


def test_a_worker_caught_mid_exec_is_found_once_its_command_line_shows(
        short_tmp: Path, monkeypatch) -> None:
    """Right after Popen returns, a vforked child's command line may read empty for a moment
    (this machine showed it in 2% of starts): stop reads such a process again instead of missing
    it. Kernel threads, which never show one, and other programs are left alone."""
    import psutil

    path = worker.socket_path(short_tmp / "node")
    ours = [sys.executable, "-m", "fedjax_split.deploy.worker", "--socket", str(path)]
    procs = [_Execing(101, ours, empty_reads=3),
             _Execing(102, [sys.executable, "-c", "pass"], empty_reads=2),
             _Execing(103, ["kworker"], empty_reads=10**6, ppid=2),
             _Execing(104, ours, empty_reads=0)]  # fmt: skip
    monkeypatch.setattr(psutil, "process_iter", lambda attrs: iter(procs))
    assert sorted(p.pid for p in worker._workers_of(path)) == [101, 104]
    assert procs[2]._left == 10**6 - 1  # read once by the scan, never again


def test_the_socket_is_per_node_and_per_version_of_the_code(short_tmp: Path, monkeypatch) -> None:
    a, b = worker.socket_path(short_tmp / "a"), worker.socket_path(short_tmp / "b")
    assert a != b and a == worker.socket_path(short_tmp / "a")
    monkeypatch.setattr(worker, "_code_version", lambda: "an upgrade")
    assert worker.socket_path(short_tmp / "a") != a
