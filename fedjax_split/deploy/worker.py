"""A warm worker per SuperNode: the process that runs our ClientApp's handlers, kept alive between
messages, so that a message costs its work and not a process start.

Flower starts a fresh ClientApp process for every message (`flwr-clientapp`). Without a worker
each message pays for importing JAX, building the node's client (data share, model, frozen
weights) and loading its compiled programs: seconds, where a small model's round is 0.1 s of work.
With it, the ClientApp process imports only Flower and this module (with `deploy.frames`) and
hands the message and its context over a Unix socket to the node's worker (Flower's protobuf
serde for all but the arrays, whose bytes go as Flower holds them: `deploy.frames`), which runs
the very handler the ClientApp would run (`handlers.HANDLERS`) and sends the reply back the same
way. Nothing in
Flower is patched: the ClientApp is still the process Flower started, and it returns the reply
Flower expects.

- One worker per state dir (a node; two SuperNodes given the same state dir share one) and per
  version of this package's code (an upgrade starts a new one). The first message starts it
  (`python -m fedjax_split.deploy.worker`, in its own session so that the ClientApp process may
  end), under a lock so that two messages at once start one worker. It serves one message at a
  time; a message that finds it ending starts a new one. It takes no GPU memory up front.
- It ends when the SuperNode that started it ends (it watches that process), after
  `IDLE_SECONDS` without a message, or when `stop` asks (the local launcher does at its end).
- The socket lives in a directory of this user's only (mode 0700): only this user's processes
  reach it. Frames are lengths and bytes, decoded by protobuf and JSON (`deploy.frames`): no
  pickle.
- An exception in a handler comes back as its class and message and is raised again in the
  ClientApp process (a UserError stays a UserError), so Flower reports it to the server as
  without a worker.
- `warm-worker=false` in the node config (or FEDJAX_SPLIT_WARM_WORKER=0) runs each handler in the
  ClientApp process as before.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedjax_split import runtime
from fedjax_split.assets import cache_dir
from fedjax_split.deploy import protocol
from fedjax_split.deploy.frames import message_from_parts, message_parts, recv_parts, send_parts
from fedjax_split.errors import UserError

IDLE_SECONDS = 1800.0  # a worker with no message for this long ends
START_SECONDS = 120.0  # how long a ClientApp waits for a worker it started to listen
REQUEST_SECONDS = 300.0  # how long the worker waits for a request's bytes, or to send a reply
ENV = "FEDJAX_SPLIT_WARM_WORKER"  # "0": no worker (each handler in its ClientApp process)
NODE_CONFIG_KEY = "warm-worker"
_RAISED = {"UserError": UserError, "ValueError": ValueError, "KeyError": KeyError,
           "TypeError": TypeError}  # fmt: skip


def enabled(node_config: Mapping[str, Any]) -> bool:
    """Whether this node's messages go to a warm worker (the default)."""
    value = node_config.get(NODE_CONFIG_KEY, os.environ.get(ENV, "1"))
    return str(value).strip().lower() not in ("0", "false", "no", "off")


def socket_path(state_dir: str | Path) -> Path:
    """The worker socket of the node whose state dir is `state_dir`: short (a Unix socket's path
    has at most 107 bytes), in a directory of this user's only."""
    base = Path(tempfile.gettempdir()) / f"fedjax_split-workers-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    if base.stat().st_uid != os.getuid() or base.stat().st_mode & 0o077:
        raise UserError(f"{base} is not this user's alone; remove it and run again")
    key = hashlib.sha256(f"{Path(state_dir).resolve()}|{_code_version()}".encode())
    return base / f"{key.hexdigest()[:24]}.sock"


def _code_version() -> str:
    """What distinguishes this package's code from another install or an upgrade: a worker
    started by older code is never handed a message by newer code (each gets its own socket)."""
    root = Path(__file__).resolve().parent.parent
    stamps = sorted((str(f.relative_to(root)), st.st_mtime_ns, st.st_size)
                    for f in root.rglob("*.py") for st in (f.stat(),))  # fmt: skip
    return hashlib.sha256(repr(stamps).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# the ClientApp's side


def handle(kind: str, msg: Any, context: Any, run_here: Callable[[Any, Any], Any]) -> Any:
    """The reply to `msg`: from the node's warm worker, started if none listens, or from
    `run_here(msg, context)` in this process when the node config turns the worker off."""
    from flwr.common import serde

    state_dir = _state_dir(context)
    if not enabled(context.node_config):
        return run_here(msg, context)
    path = socket_path(state_dir)
    request = [kind.encode(), serde.context_to_proto(context).SerializeToString(),
               *message_parts(msg)]  # fmt: skip
    for attempt in (1, 2):
        try:
            with _connect(path, state_dir) as conn:
                send_parts(conn, request)
                status, *payload = recv_parts(conn)
            break
        except ConnectionError:  # the worker ended as this message came: start a new one, once
            if attempt == 2:
                raise
    if status == b"ok":
        return message_from_parts(payload)
    error = b"".join(payload).decode()
    name, _, text = error.partition(":")
    raise _RAISED.get(name, RuntimeError)(text.strip() if name in _RAISED else error)


def _state_dir(context: Any) -> Path:
    value = context.node_config.get(protocol.STATE_DIR)
    if value:
        return Path(str(value))
    return cache_dir() / "flower_nodes"


@contextlib.contextmanager
def _connect(path: Path, state_dir: Path):
    """A connection to the worker at `path`, which is started first if none listens there."""
    conn = _try_connect(path)
    if conn is None:
        import fcntl

        with open(f"{path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one ClientApp starts it; the others wait
            conn = _try_connect(path)
            if conn is None:
                conn = _start(path, state_dir)
    try:
        yield conn
    finally:
        conn.close()


def _try_connect(path: Path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
    except OSError:
        conn.close()
        return None
    return conn


def _watched_pid() -> int | None:
    """The process whose end ends the worker: the SuperNode above this ClientApp process, this
    process when it is not one Flower started (a test, a notebook), else none (idle timeout)."""
    import psutil

    me = psutil.Process()
    for parent in me.parents():
        with contextlib.suppress(psutil.Error):
            if any("flower-supernode" in part for part in parent.cmdline()):
                return parent.pid
    started_by_flower = any("flwr-clientapp" in part for part in me.cmdline())
    return None if started_by_flower else me.pid


def _start(path: Path, state_dir: Path) -> socket.socket:
    """Starts the worker for `state_dir` in its own session and waits until it listens."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a socket file left by a worker that was killed
    state_dir.mkdir(parents=True, exist_ok=True)
    watched = _watched_pid()
    args = [sys.executable, "-m", "fedjax_split.deploy.worker", "--socket", str(path)]
    if watched is not None:
        args += ["--watch-pid", str(watched)]
    # several nodes' workers may share a host and its GPU: none takes its memory up front
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **os.environ}
    with open(state_dir / "worker.log", "ab") as log:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        conn = _try_connect(path)
        if conn is not None:
            return conn
        if proc.poll() is not None:
            raise RuntimeError(f"the node's worker exited at start; see {state_dir / 'worker.log'}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"the node's worker did not listen within {START_SECONDS:g} s")


def wait_ended(procs: Sequence[Any], seconds: float) -> None:
    """Waits (at most `seconds` in all) until each psutil process in `procs` has ended: gone, or
    a zombie that its parent has yet to reap (a SIGKILLed process takes a moment to exit)."""
    if not procs:
        return
    import psutil

    deadline = time.monotonic() + seconds
    for proc in procs:
        with contextlib.suppress(psutil.Error):  # gone already
            while proc.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
                time.sleep(0.02)


def _is_worker_of(cmdline: Sequence[str], path: Path) -> bool:
    return "fedjax_split.deploy.worker" in cmdline and str(path) in cmdline


def _workers_of(path: Path, settle_seconds: float = 1.0) -> list[Any]:
    """The processes serving `path`, by command line.

    A process caught in the middle of its exec shows an empty command line for a moment: the
    parent of a vforked child resumes before the kernel has set the new program's arguments. Such
    a process (a user process, not a zombie) is read again until its command line shows, for at
    most `settle_seconds`, so that a worker started just before `stop` is not missed."""
    import psutil

    found, unsettled = [], []
    for proc in psutil.process_iter(["cmdline", "status", "ppid"]):
        info = proc.info
        if _is_worker_of(info["cmdline"] or [], path):
            found.append(proc)
        elif (not info["cmdline"] and info["status"] not in (None, psutil.STATUS_ZOMBIE)
              and info["ppid"] not in (None, 0, 2) and proc.pid != 2):  # fmt: skip
            unsettled.append(proc)  # kernel threads (children of pid 2) never show one
    deadline = time.monotonic() + settle_seconds
    while unsettled and time.monotonic() < deadline:
        time.sleep(0.02)
        still = []
        for proc in unsettled:
            try:
                cmdline = proc.cmdline()
            except psutil.Error:
                continue  # ended, or not ours to read
            if _is_worker_of(cmdline, path):
                found.append(proc)
            elif not cmdline:
                still.append(proc)
        unsettled = still
    return found


def stop(state_dir: str | Path, wait_seconds: float = 10.0) -> None:
    """Ends the worker of `state_dir`, if one runs (the local launcher, at its end), and waits
    until it has ended: a caller that stops a node's processes may count on none being left.

    The worker is found by its command line, not by its pid file: a worker writes that a moment
    after it starts, and a stale one may name another process."""
    import signal

    import psutil

    path = socket_path(state_dir)
    doomed = []
    for proc in _workers_of(path):
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
            doomed.append(proc)
    wait_ended(doomed, wait_seconds)
    for stale in (Path(f"{path}.pid"), path):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()


# ---------------------------------------------------------------------------------------------
# the worker's side


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _answer(parts: list[bytes], handlers: Mapping[str, Callable[[Any, Any], Any]]) -> list[bytes]:
    """The reply frame to one request frame (kind, context, the message's parts): b"ok" and the
    reply Message's parts (`message_parts`), or b"error" and "ClassName: message"."""
    from flwr.common import serde
    from flwr.proto.message_pb2 import Context as ProtoContext

    try:
        if len(parts) < 4 or parts[0].decode() not in handlers:
            raise ValueError("a malformed request reached the node's worker")
        context = serde.context_from_proto(ProtoContext.FromString(parts[1]))
        msg = message_from_parts(parts[2:])
        reply = handlers[parts[0].decode()](msg, context)
        return [b"ok", *message_parts(reply)]
    except Exception as e:  # noqa: BLE001 - every failure goes back to the ClientApp
        return [b"error", f"{type(e).__name__}: {e}".encode()]


def serve(
    path: Path,
    watch_pid: int | None,
    handlers: Mapping[str, Callable[[Any, Any], Any]],
    idle_seconds: float = IDLE_SECONDS,
) -> None:
    """Answers requests on `path` one at a time, each with its kind's handler, until the watched
    process ends or none came for `idle_seconds`."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    server.bind(str(path))
    os.chmod(path, 0o600)
    bound = path.stat().st_ino
    Path(f"{path}.pid").write_text(str(os.getpid()))
    server.listen(16)
    server.settimeout(1.0)
    last = time.monotonic()
    try:
        while _alive(watch_pid) and time.monotonic() - last < idle_seconds:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(REQUEST_SECONDS)  # a client stalled mid-frame does not block it
                try:
                    send_parts(conn, _answer(recv_parts(conn), handlers))
                except (ConnectionError, struct.error, OSError) as e:
                    print(f"worker: dropped a connection ({e})", file=sys.stderr, flush=True)
            last = time.monotonic()
    finally:
        server.close()
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_ino == bound:  # not the socket of a worker started after it
                path.unlink()
                Path(f"{path}.pid").unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedjax_split.deploy.worker",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--socket", required=True, help="Unix socket to listen on")
    p.add_argument("--watch-pid", type=int, default=None, help="end when this process ends")
    p.add_argument("--idle-seconds", type=float, default=IDLE_SECONDS)
    args = p.parse_args(argv)
    runtime.tune_malloc()  # before the handlers' modules import JAX (which start its threads)
    runtime.one_line_warnings()
    from fedjax_split.deploy.handlers import HANDLERS

    serve(Path(args.socket), args.watch_pid, logged(HANDLERS), args.idle_seconds)
    return 0


def logged(
    handlers: Mapping[str, Callable[[Any, Any], Any]],
) -> dict[str, Callable[[Any, Any], Any]]:
    """`handlers`, each of which says in the worker's log what a message cost: its seconds and
    the programs XLA compiled for it or loaded from the persistent cache (a node's first round
    compiles unless the cache holds its programs: `runtime.enable_xla_cache`)."""
    from fedjax_split import compilation

    log = compilation.watch()

    def wrap(kind: str, handler: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def run(msg: Any, context: Any) -> Any:
            mark, t0 = log.mark(), time.perf_counter()
            try:
                return handler(msg, context)
            finally:
                got = compilation.report(log.since(mark))
                print(f"worker: {kind} in {time.perf_counter() - t0:.2f} s; "
                      f"{got['programs_compiled']} programs compiled "
                      f"({got['compile_seconds']:.1f} s), {got['programs_from_cache']} loaded "
                      "from the cache", file=sys.stderr, flush=True)  # fmt: skip

        return run

    return {kind: wrap(kind, handler) for kind, handler in handlers.items()}


if __name__ == "__main__":
    sys.exit(main())
