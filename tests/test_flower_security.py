"""Security as deployed: a Flower federation on 127.0.0.1 secured as on real machines.

The SuperLink serves TLS with a certificate made here (`deploy.certs`) and admits only registered
SuperNodes (`--enable-supernode-auth`; keys registered with `flwr supernode register`). Two
registered SuperNodes (partition-id 0 and 1 of a K=2 run) train; beside them three intruders try
to join, each claiming a real site's partition id: a stranger (TLS, a key nobody registered), a
keyless node (TLS, no key: it would register itself were authentication off) and a plaintext
node (`--insecure`). The run finishes with the simulation's figures; no intruder became a node
or ran a client, and nothing local crossed the wire.
"""

from __future__ import annotations

import json
import re
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from run_fixtures import (  # noqa: F401 (private_cache is an autouse fixture)
    cli_env,
    private_cache,
    tiny_sst2_files,
)
from test_flower import (
    TIMEOUT,
    _args,
    _comparable,
    _local_paths_and_digests,
    _metrics,
    _no_processes_left,
    _simulate,
)

from fedjax_split import flower
from fedjax_split.deploy import certs, protocol
from fedjax_split.deploy.launch import Federation, NodeAccess, Tls, write_app
from fedjax_split.errors import UserError

pytestmark = pytest.mark.xdist_group("federation")  # one at a time: see pyproject.toml

# one round (train, then evaluate): what security needs shown, in about a minute
FLAGS = {"clients": 2, "rounds": 1, "quantize": "fp16", "critical_layer": 1, "eval_every": 1}
SITES = ("site_0", "site_1", "stranger", "keyless", "plaintext")  # SuperNode i, in this order
ADMITTED = re.compile(r"SuperNode ID: (\d+)")  # what a SuperNode logs once the SuperLink took it
JOIN = re.compile(r'"POST /v1/fleet/(register|activate)-node HTTP/1.1" (\d+)')  # SuperLink's log


def _flwr_nodes(fed: Federation) -> list[dict[str, Any]]:
    """The SuperLink's own list of nodes (`flwr supernode ls`, over TLS like any operator)."""
    res = subprocess.run(["flwr", "supernode", "ls", "local", "--format", "json"], env=fed.env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    reply = json.loads(res.stdout[res.stdout.index("{") :])
    assert reply["success"], reply
    return reply["nodes"]


def _run_secured(env: dict, out: Path, record: Path) -> dict[str, Any]:
    """The secured federation runs FLAGS to its end; returns what the test checks, gathered
    while every process still runs, then stops them all."""
    base = env["base"]
    server = certs.make_server(base / "certs")
    keys = {name: certs.make_node_key(base / "keys" / name)[0] for name in SITES[:3]}
    access = [NodeAccess(keys["site_0"]), NodeAccess(keys["site_1"]),
              NodeAccess(keys["stranger"], register=False), NodeAccess(),
              NodeAccess(tls=False)]  # fmt: skip
    flower_dir = out / "flower"  # as `python -m fedjax_split.flower` lays it out
    nodes = [{protocol.PARTITION_ID: i % 2, protocol.STATE_DIR: str(flower_dir / "nodes" / name)}
             for i, name in enumerate(SITES)]  # fmt: skip
    config, _ = flower.parse(_args(env, out, **FLAGS))
    deploy = {"connect_timeout": 60.0, "round_timeout": 60.0}
    status = base / "status.json"
    app = write_app(base / "app", flower.run_config(flower._absolute(config), deploy, str(status)))
    proc_env = {k: v for k, v in env["env"].items() if k != "PATH"}  # the launcher sets PATH
    proc_env.update({protocol.RECORD_ENV: str(record), "FEDJAX_SPLIT_FLOWER_RUN": str(out)})
    fed = Federation(nodes, flower_dir / "logs", env=proc_env,
                     tls=Tls(server.ca_cert, server.cert, server.key), access=access)  # fmt: skip
    try:
        fed.start()
        code = fed.submit(app, timeout=TIMEOUT)
        return {
            "code": code,
            "status": json.loads(status.read_text()) if status.is_file() else None,
            "exits": [p.poll() if p is not None else None for p in fed.nodes],
            "flwr_nodes": _flwr_nodes(fed),
            "node_ids": dict(fed.node_ids),
            "stranger_key": keys["stranger"],
            "logs": flower_dir / "logs",
            "run_log": fed.run_log(),
        }
    finally:
        fed.close()


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("secured")
    env = {**tiny_sst2_files(base), "env": cli_env(jax_cache=base / "jax_cache")}
    out, record = base / "run", base / "sent"
    result = _run_secured(env, out, record)
    _no_processes_left(str(out))
    return {**result, "base": base, "out": out, "record": record,
            "sim": _simulate(env, "sim", **FLAGS)}  # fmt: skip


def _log(secured: dict, name: str) -> str:
    return (secured["logs"] / name).read_text()


def test_registered_nodes_train_and_the_run_equals_the_simulation(secured: dict) -> None:
    assert secured["code"] == 0, secured["run_log"].read_text()[-3000:]
    assert secured["status"] is not None and secured["status"]["status"] == "done"
    got, want = _metrics(secured["out"]), _metrics(secured["sim"])
    assert len(got) == 1 and [_comparable(r) for r in got] == [_comparable(r) for r in want]
    assert all(r["clients_sampled"] == [0, 1] and r["clients_failed"] == [] for r in got)
    # both sites were registered, admitted under the node id registration gave them, and kept
    # their own local parts
    for i in (0, 1):
        admitted = ADMITTED.findall(_log(secured, f"supernode-{i}.log"))
        assert admitted == [str(secured["node_ids"][i])]
        assert (secured["out"] / "flower" / "nodes" / SITES[i]).is_dir()


def test_an_unregistered_key_a_keyless_and_a_plaintext_node_are_refused(secured: dict) -> None:
    """The SuperLink's own list holds the two registered nodes only (both online); no intruder
    was ever given a node id or ran a ClientApp (its state dir was never made). The requests to
    join that reached the SuperLink: the two sites' activations, the stranger's activation and
    the keyless node's registration, both refused (412); none of the plaintext node's."""
    listed = {int(n["node-id"]): n["status"] for n in secured["flwr_nodes"]}
    assert listed == {secured["node_ids"][0]: "online", secured["node_ids"][1]: "online"}
    joins = sorted(JOIN.findall(_log(secured, "superlink.log")))
    assert joins == [("activate", "200")] * 2 + [("activate", "412"), ("register", "412")]
    for i in (2, 3, 4):
        assert not ADMITTED.search(_log(secured, f"supernode-{i}.log")), SITES[i]
        assert not (secured["out"] / "flower" / "nodes" / SITES[i]).exists(), SITES[i]

    # the stranger: TLS handshake fine, activation refused for its key, and it gave up (status 1)
    stranger = _log(secured, "supernode-2.log")
    assert "Failed to activate SuperNode" in stranger and secured["exits"][2] == 1
    spki = serialization.load_ssh_public_key(certs.public_key_path(secured["stranger_key"])
                                             .read_bytes()).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)  # fmt: skip
    refusal = next(x for x in _log(secured, "superlink.log").splitlines()
                   if "No SuperNode found with the given public key" in x)  # fmt: skip
    assert repr(spki)[2:-1] in refusal  # the SuperLink refused exactly the stranger's key

    # the keyless node: Flower's own registration is closed with authentication on
    keyless = _log(secured, "supernode-3.log")
    assert "All SuperNodes must be registered via the CLI" in keyless and secured["exits"][3] == 1

    # the plaintext node: never got past the TLS port's handshake, kept trying through the run
    plaintext = _log(secured, "supernode-4.log")
    assert "Starting insecure channel" in plaintext and secured["exits"][4] is None


def test_no_message_carries_a_local_part_or_an_example(secured: dict) -> None:
    """Every array sent is a global-part parameter, none has the content of a local part the
    nodes held; only the two registered clients ever replied to a train message."""
    sent = [json.loads(x) for f in secured["record"].glob("*.jsonl")
            for x in f.read_text().splitlines()]  # fmt: skip
    kinds = {(e["sender"], e["type"]) for e in sent}
    assert kinds >= {("server", "train"), ("client", "train"), ("server", "evaluate")}
    assert sum(e["sender"] == "client" and e["type"] == "train" for e in sent) == 2
    local_paths, local_digests = _local_paths_and_digests(secured["out"])
    assert local_paths and any(p.startswith("classifier") for p in local_paths)
    arrays = [a for e in sent for a in e["arrays"]]
    assert arrays and all(a["dtype"] == "uint16" for a in arrays)  # fp16 bits: no token ids
    assert all(a["path"].startswith(("embeddings/", "encoder/layer_0/")) for a in arrays)
    assert not {a["path"] for a in arrays} & local_paths
    assert not {a["sha256"] for a in arrays} & local_digests


# --- deploy.certs and the launcher's secured commands, without Flower's processes ---


def _handshake(ca: Path, cert: Path, key: Path, host: str = "127.0.0.1") -> str:
    """A TLS handshake on 127.0.0.1 between a server holding cert/key and a client that trusts
    `ca` only and checks the certificate names `host`; returns the client's TLS version."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(30)

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(1)
            except (ssl.SSLError, OSError):
                pass  # the client refused us: its side of the test says so

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            with socket.create_connection(listener.getsockname(), timeout=30) as raw:
                with client_ctx.wrap_socket(raw, server_hostname=host) as tls:
                    version = tls.version()
                    tls.sendall(b"x")
        finally:
            thread.join(timeout=30)
    return str(version)


def test_the_server_certificate_verifies_against_its_ca_for_loopback(tmp_path: Path) -> None:
    files = certs.make_server(tmp_path / "a")
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert _handshake(files.ca_cert, files.cert, files.key).startswith("TLS")
    assert _handshake(files.ca_cert, files.cert, files.key, host="localhost").startswith("TLS")
    with pytest.raises(ssl.SSLCertVerificationError):  # a name it was not made for
        _handshake(files.ca_cert, files.cert, files.key, host="example.org")
    other = certs.make_server(tmp_path / "b")  # another consortium's CA does not vouch for it
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(other.ca_cert, files.cert, files.key)
    for key in (files.ca_key, files.key):
        assert key.stat().st_mode & 0o777 == 0o600
    for public in (files.ca_cert, files.cert):
        assert public.stat().st_mode & 0o777 == 0o644


def test_a_node_key_is_what_flower_reads_and_only_its_owner_can_read_it(tmp_path: Path) -> None:
    from flwr.cli.supernode.register import try_load_public_key

    private, public = certs.make_node_key(tmp_path / "keys" / "site_0")
    assert public == tmp_path / "keys" / "site_0.pub"
    assert private.stat().st_mode & 0o777 == 0o600 and public.stat().st_mode & 0o777 == 0o644
    key = serialization.load_ssh_private_key(private.read_bytes(), None)  # as flower-supernode
    spki = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    assert try_load_public_key(public) == spki  # `flwr supernode register` reads the same key
    assert public.read_text().startswith("ecdsa-sha2-nistp384 ")


def test_no_key_or_certificate_is_overwritten(tmp_path: Path, capsys: Any) -> None:
    private, public = certs.make_node_key(tmp_path / "k")
    before = private.read_bytes()
    with pytest.raises(UserError, match="exists already"):
        certs.make_node_key(tmp_path / "k")
    assert private.read_bytes() == before
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "server.key").write_text("mine")
    assert certs.main(["server", str(tmp_path / "srv"), "--host", "10.1.2.3"]) == 2
    assert "server.key exists already" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "srv").iterdir()) == ["server.key"]  # nothing made


def test_the_command_line_makes_a_server_certificate_for_the_hosts_given(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "fedjax_split.deploy.certs", "server", str(tmp_path / "c"),
         "--host", "link.example.org", "--host", "10.1.2.3", "--days", "30"],
        capture_output=True, text=True, timeout=120, env=cli_env(),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    cert = x509.load_pem_x509_certificate((tmp_path / "c" / "server.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["link.example.org", "localhost"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.1.2.3", "127.0.0.1"]
    assert cert.subject.rfc4514_string() == "CN=link.example.org"
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days == 30


def test_the_launcher_secures_each_command_and_keeps_the_insecure_default(tmp_path: Path) -> None:
    nodes = [{protocol.PARTITION_ID: 0}, {protocol.PARTITION_ID: 1}]
    plain = Federation(nodes, tmp_path / "logs")
    try:
        plain._write_connection()
        assert "insecure = true" in (plain.home / "config.toml").read_text()
        assert plain._superlink_security() == ["--insecure"]
        assert plain.node_args(0)[:2] == ["flower-supernode", "--insecure"]
    finally:
        plain.close()
    tls = Tls(Path("c/ca.crt"), Path("c/server.pem"), Path("c/server.key"))
    with pytest.raises(UserError, match="TLS SuperLink"):
        Federation(nodes, tmp_path / "logs", access=[NodeAccess(), NodeAccess()])
    fed = Federation(nodes, tmp_path / "logs", tls=tls,
                     access=[NodeAccess(Path("k/site_0")), NodeAccess(tls=False)])  # fmt: skip
    try:
        fed._write_connection()
        config = (fed.home / "config.toml").read_text()
        assert f'root-certificates = "{Path("c/ca.crt").resolve()}"' in config
        assert "insecure" not in config
        assert fed._superlink_security() == [
            "--ssl-ca-certfile", "c/ca.crt", "--ssl-certfile", "c/server.pem",
            "--ssl-keyfile", "c/server.key", "--enable-supernode-auth"]  # fmt: skip
        assert fed.node_args(0)[1:5] == ["--root-certificates", "c/ca.crt",
                                         "--auth-supernode-private-key", "k/site_0"]  # fmt: skip
        assert fed.node_args(1)[1:3] == ["--insecure", "--superlink"]
    finally:
        fed.close()
