"""A local federation of real processes: one Flower SuperLink and N SuperNodes on 127.0.0.1.

The processes are Flower's own commands (`flower-superlink`, `flower-supernode`, `flwr run`), run
exactly as on separate machines, only all on loopback with free ports. By default insecure (no
TLS: the traffic never leaves the machine); with `tls` secured as on real machines: the
SuperLink serves TLS, admits only SuperNodes whose public keys were registered through its
Control API (`flwr supernode register`), and each SuperNode verifies it against the CA (`Tls`,
`NodeAccess`; docs/deployment.md). Each SuperNode is told its partition id and its own state
directory in its node config. Every process starts in its own session, and `Federation.close`
kills each process's whole tree (Flower's SuperExec detaches its children into new sessions, so
a process-group kill alone would miss them), so nothing outlives the federation.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from fedjax_split.deploy import logs, worker
from fedjax_split.errors import UserError

HOST = "127.0.0.1"
APP_PUBLISHER = "fedjax-split"
SERVER_APP = "fedjax_split.deploy.server_app:app"
CLIENT_APP = "fedjax_split.deploy.client_app:app"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _toml_value(value: Any) -> str:
    """A TOML literal for a run-config value (str, bool, int, float)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def write_app(app_dir: Path, run_config: Mapping[str, Any]) -> Path:
    """A Flower App directory (just a pyproject.toml) whose components are our installed apps and
    whose run config holds `run_config` (keys as Flower's run config takes them)."""
    app_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        "[project]",
        'name = "fedjax-split-app"',
        'version = "0.1.0"',
        'description = "fedjax_split: FedSplitBERT rounds on Flower"',
        'license = "Apache-2.0"',
        "",
        "[tool.flwr.app]",
        f'publisher = "{APP_PUBLISHER}"',
        "",
        "[tool.flwr.app.components]",
        f'serverapp = "{SERVER_APP}"',
        f'clientapp = "{CLIENT_APP}"',
        "",
        "[tool.flwr.app.config]",
        *(f"{key} = {_toml_value(value)}" for key, value in run_config.items()),
    ]
    (app_dir / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return app_dir


def _descendants(pid: int) -> list:
    """Every process below `pid` (children first found, then theirs), as psutil processes."""
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - gone already, or no psutil: nothing to add
        return []


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`, its session and every descendant (even those in other sessions), and wait
    until they have ended."""
    below = _descendants(proc.pid)
    for pid in [proc.pid, *(p.pid for p in below)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session started for it
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    worker.wait_ended(below, 10)


def link_identical_files(directory: Path, pattern: str = "*.npz") -> int:
    """Makes files under `directory` matching `pattern` that hold the same bytes one file with
    several names (hard links); the bytes freed. For the nodes of a local federation, whose
    state dirs share one disk although each stands for a site of its own: every node keeps the
    global part it last received for its site's export, the same file N times. Safe because a
    node never rewrites a file in place (it writes a new one and renames it over the old), so a
    name that changes leaves the others as they were."""
    by_size: dict[int, list[Path]] = {}
    for f in sorted(directory.rglob(pattern)) if directory.is_dir() else ():
        with contextlib.suppress(OSError):  # a file a late node removed: nothing to link
            if f.is_file() and not f.is_symlink():
                by_size.setdefault(f.stat().st_size, []).append(f)
    freed = 0
    for size, files in by_size.items():
        first: dict[str, Path] = {}
        for f in files if len(files) > 1 else ():
            try:
                digest = hashlib.sha256(f.read_bytes()).hexdigest()
            except OSError:  # gone or unreadable since: leave it as it is
                continue
            keep = first.setdefault(digest, f)
            if keep == f or os.path.samefile(keep, f):
                continue
            tmp = f.with_name(f"{f.name}.{secrets.token_hex(6)}.tmp")
            try:
                os.link(keep, tmp)
                os.replace(tmp, f)
                freed += size
            except OSError:  # another file system, or links refused: keep the copy
                tmp.unlink(missing_ok=True)
    return freed


def process_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the federation's processes: this interpreter's scripts first on PATH
    (SuperLink and SuperNode start `flower-superexec`, which starts `flwr-serverapp` /
    `flwr-clientapp`), no telemetry or update check (no network beyond loopback), and a short
    SuperExec poll (a message waits for it before its process starts)."""
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bindir, env.get("PATH", "")])
    env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    env.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.1")
    env.update(extra or {})
    return env


@dataclass(frozen=True)
class Tls:
    """A SuperLink served over TLS (the files `deploy.certs.make_server` writes). In flwr 1.41 its
    Fleet, Control and Runtime APIs share one HTTPS port, so the SuperNodes, the `flwr` CLI and
    the SuperLink's own ServerApp all verify it against `ca_cert`. `node_auth`: only SuperNodes
    whose public key was registered may connect (`--enable-supernode-auth`; TLS only)."""

    ca_cert: Path
    cert: Path
    key: Path
    node_auth: bool = True


@dataclass(frozen=True)
class NodeAccess:
    """How one SuperNode connects to a TLS SuperLink.

    private_key: its OpenSSH EC key (`--auth-supernode-private-key`), the public key beside it as
    `KEY.pub` (`deploy.certs.make_node_key`). register: that public key is registered through the
    SuperLink's Control API before the node starts (False: a stranger's key). tls: False starts
    it `--insecure` (it cannot reach a TLS SuperLink: for tests that it is refused).
    """

    private_key: Path | None = None
    register: bool = True
    tls: bool = True


class Federation:
    """SuperLink + SuperNodes on loopback; `submit` runs a Flower App on them with `flwr run`.

    node_configs: one mapping per SuperNode (e.g. {"partition-id": 0, "state-dir": "..."}).
    log_dir: where each process's output goes (superlink.log, supernode-<i>.log, run-<k>.log),
    without colour codes or Flower's empty records (`logs.clean`).
    tls: serve the SuperLink over TLS (None: insecure); access: one `NodeAccess` per SuperNode
    (default: TLS, no key). `node_ids` maps a registered node's index to its Flower node id.
    """

    def __init__(
        self,
        node_configs: Sequence[Mapping[str, Any]],
        log_dir: Path,
        *,
        env: Mapping[str, str] | None = None,
        start_timeout: float = 60.0,
        tls: Tls | None = None,
        access: Sequence[NodeAccess] | None = None,
    ) -> None:
        if access is not None and (tls is None or len(access) != len(node_configs)):
            raise UserError("node access needs a TLS SuperLink and one entry per SuperNode")
        self.node_configs = [dict(c) for c in node_configs]
        self.tls = tls
        self.access = list(access) if access is not None else [NodeAccess()] * len(node_configs)
        self.node_ids: dict[int, int] = {}
        self.log_dir = Path(log_dir)
        self.start_timeout = start_timeout
        self.home = Path(tempfile.mkdtemp(prefix="fedjax_split_flwr_"))
        self.env = process_env({**(env or {}), "FLWR_HOME": str(self.home)})
        self.port = free_port()
        self.superlink: subprocess.Popen | None = None
        self.nodes: list[subprocess.Popen | None] = []
        self._copiers: list[threading.Thread] = []
        self._runs = 0

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def _start(self, args: list[str], log: Path, echo: TextIO | None = None) -> subprocess.Popen:
        """`args` started in its own session; a thread copies its output, one clean line per
        event (`logs.copy_lines`), to `log` (and `echo`) until the last process holding the
        pipe ends (its children inherit it)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            args,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        copier = threading.Thread(
            target=logs.copy_lines, args=(proc.stdout, log, echo), daemon=True
        )
        copier.start()
        self._copiers.append(copier)
        return proc

    def start(self) -> Federation:
        """Starts the SuperLink, waits until it listens, registers the SuperNodes' public keys
        (with TLS), then starts the SuperNodes."""
        self._write_connection()
        self.superlink = self._start(
            [
                "flower-superlink",
                *self._superlink_security(),
                "--host",
                HOST,
                "--port",
                str(self.port),
                # the legacy gRPC Fleet and Control APIs still start: keep them on loopback too
                "--fleet-api-address",
                f"{HOST}:{free_port()}",
                "--control-api-address",
                f"{HOST}:{free_port()}",
                "--disable-runtime-dependency-installation",
            ],
            self.log_dir / "superlink.log",
        )
        self._wait_listening(self.port, self.superlink, "superlink.log")
        self._register_keys()
        for i in range(len(self.node_configs)):
            self.nodes.append(self._start(self.node_args(i), self.log_dir / f"supernode-{i}.log"))
        return self

    def _write_connection(self) -> None:
        """The `flwr` CLI's connection to this SuperLink ($FLWR_HOME/config.toml): insecure, or
        verifying the SuperLink against the CA (an absolute path, as Flower requires)."""
        if self.tls is None:
            security = "insecure = true\n"
        else:
            ca = _toml_value(str(Path(self.tls.ca_cert).resolve()))
            security = f"root-certificates = {ca}\n"
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "{self.address}"\n'
            + security
        )

    def _superlink_security(self) -> list[str]:
        if self.tls is None:
            return ["--insecure"]
        tls = self.tls
        files = ["--ssl-ca-certfile", str(tls.ca_cert), "--ssl-certfile", str(tls.cert),
                 "--ssl-keyfile", str(tls.key)]  # fmt: skip
        return files + (["--enable-supernode-auth"] if tls.node_auth else [])

    def node_args(self, i: int) -> list[str]:
        """The `flower-supernode` command of SuperNode `i`."""
        access = self.access[i]
        node_config = " ".join(f"{k}={_toml_value(v)}" for k, v in self.node_configs[i].items())
        if self.tls is None or not access.tls:
            security = ["--insecure"]
        else:
            security = ["--root-certificates", str(self.tls.ca_cert)]
        if access.private_key is not None:
            security += ["--auth-supernode-private-key", str(access.private_key)]
        return ["flower-supernode", *security, "--superlink", self.address, "--host", HOST,
                "--port", str(free_port()), "--node-config", node_config]  # fmt: skip

    def _register_keys(self) -> None:
        """`flwr supernode register KEY.pub` for each SuperNode to be registered, through the
        SuperLink's Control API; records the node ids Flower gives them."""
        from fedjax_split.deploy.certs import public_key_path  # cryptography: secured runs only

        for i, access in enumerate(self.access):
            if access.private_key is None or not access.register:
                continue
            public = public_key_path(access.private_key)
            args = ["flwr", "supernode", "register", str(public), "local", "--format", "json"]
            res = subprocess.run(args, env=self.env, capture_output=True, text=True,
                                 stdin=subprocess.DEVNULL, timeout=self.start_timeout)  # fmt: skip
            try:  # on failure flwr still exits 0 with --format json: read what it says
                reply = json.loads(res.stdout[res.stdout.index("{") :])
            except ValueError:
                reply = {"error-message": (res.stderr or res.stdout).strip()}
            if not reply.get("success"):
                why = " ".join(str(reply.get("error-message", "")).split())
                raise UserError(f"could not register SuperNode {i}'s key {public}: {why}")
            self.node_ids[i] = int(reply["node-id"])

    def _wait_listening(self, port: int, proc: subprocess.Popen, log_name: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise UserError(
                    f"flower-superlink exited at start (status {proc.returncode}); see "
                    f"{self.log_dir / log_name}"
                )
            try:
                with socket.create_connection((HOST, port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        raise UserError(f"flower-superlink did not listen within {self.start_timeout:.0f} s")

    def submit(self, app_dir: Path, timeout: float, echo: TextIO | None = None) -> int:
        """`flwr run APP_DIR --stream` against this federation; returns its exit status (the
        command returns when the run ends). Past `timeout` seconds it is killed: status 124.
        Its output (the ServerApp's log, streamed) goes to run-<k>.log and, line by line, to
        `echo` when given."""
        self._runs += 1
        args = ["flwr", "run", str(app_dir), "local", "--stream"]
        proc = self._start(args, self.run_log(), echo)
        copier = self._copiers[-1]
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            return 124
        finally:
            if proc.poll() is None:
                kill_tree(proc)
            copier.join(timeout=10)

    def run_log(self) -> Path:
        """The output of the latest `submit` (the ServerApp's log lines, streamed)."""
        return self.log_dir / f"run-{self._runs}.log"

    def kill_node(self, index: int) -> None:
        """SIGKILL SuperNode `index` and everything it started, its warm worker too (a machine
        that goes away)."""
        proc = self.nodes[index]
        if proc is not None:
            kill_tree(proc)
            self.nodes[index] = None
        state_dir = self.node_configs[index].get("state-dir")
        if state_dir:
            worker.stop(state_dir)

    def close(self) -> None:
        """Kills every process of the federation (nodes first) and removes its Flower home."""
        for i in range(len(self.nodes)):
            self.kill_node(i)
        if self.superlink is not None:
            kill_tree(self.superlink)
            self.superlink = None
        deadline = time.monotonic() + 10  # the pipes close with the processes just killed
        for copier in self._copiers:
            copier.join(timeout=max(0.0, deadline - time.monotonic()))
        self._copiers = []
        shutil.rmtree(self.home, ignore_errors=True)

    def __enter__(self) -> Federation:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
