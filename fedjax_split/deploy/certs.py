"""The keys and certificates a consortium needs to run Flower secured: TLS and SuperNode keys.

- The server's operator makes a CA and a server certificate signed by it for the SuperLink's
  host names and addresses (`make_server`): `flower-superlink --ssl-ca-certfile ca.crt
  --ssl-certfile server.pem --ssl-keyfile server.key`. Every site and the `flwr` CLI get only
  ca.crt (`--root-certificates`, `root-certificates` in the CLI's connection) and so know they
  talk to that SuperLink.
- Each site makes its own SuperNode key pair (`make_node_key`): the private key stays at the
  site (`flower-supernode --auth-supernode-private-key KEY`), the public key goes to the
  server's operator, who registers it (`flwr supernode register KEY.pub <connection>`); with
  `--enable-supernode-auth` the SuperLink admits only registered keys.

Flower 1.41 reads a SuperNode's keys in OpenSSH format (`load_ssh_private_key`,
`load_ssh_public_key`) and takes NIST curves only: a P-384 key, as `ssh-keygen -t ecdsa -b 384`
makes. Private keys are written readable by their owner only (0600); no file is overwritten
(a CA or a key replaced by mistake would lock the whole consortium out). `cryptography` comes
with flwr. Command line: `python -m fedjax_split.deploy.certs server|node ...` (`--help`).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedjax_split.errors import UserError, report

CURVE = ec.SECP384R1  # a NIST curve: Flower refuses others for SuperNode keys
LOOPBACK = ("localhost", "127.0.0.1")
PRIVATE, PUBLIC = 0o600, 0o644


@dataclass(frozen=True)
class ServerFiles:
    """What `make_server` wrote: the SuperLink's three TLS files and the CA's key."""

    ca_cert: Path  # ca.crt: give it to every site and to whoever runs `flwr`
    ca_key: Path  # ca.key: keep it offline; it signs new server certificates
    cert: Path  # server.pem
    key: Path  # server.key


def _refuse_existing(paths: Sequence[Path]) -> None:
    """Checked for every file before any is written: a refusal leaves no half-made set."""
    for path in paths:
        if path.exists():
            raise UserError(f"{path} exists already; not overwriting a key or certificate")


def _write(path: Path, data: bytes, mode: int) -> Path:
    """`data` to a new file created with `mode` (never an existing one: O_EXCL), so a private
    key is never readable by others, not even for a moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise UserError(f"{path} exists already; not overwriting a key or certificate") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)  # the umask may have taken bits away from a public file
    return path


def _private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    """Each host as an IP address entry when it is one, else as a DNS name (TLS clients check
    an address against IP entries only)."""
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    days: int,
) -> x509.CertificateBuilder:
    """A builder for `subject`'s certificate, valid from a minute ago (clocks differ a little)
    for `days`, issued by `issuer` (None: self-signed)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer is not None else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), False
        )
    )


_KEY_USES = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
             "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")


def _key_usage(*allowed: str) -> x509.KeyUsage:
    """X.509 key usage with exactly the `allowed` uses on (x509.KeyUsage takes all nine)."""
    unknown = set(allowed) - set(_KEY_USES)
    if unknown:
        raise ValueError(f"unknown key uses {sorted(unknown)}")
    return x509.KeyUsage(**{use: use in allowed for use in _KEY_USES})


def _make_ca(days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(CURVE())
    usage = _key_usage("digital_signature", "key_cert_sign", "crl_sign")
    cert = (
        _certificate("fedjax_split consortium CA", key, None, key, days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .sign(key, hashes.SHA384())
    )
    return cert, key


def make_server(out_dir: Path, hosts: Sequence[str] = (), *, days: int = 365) -> ServerFiles:
    """A new CA and the SuperLink's certificate signed by it, valid for `days` for `hosts` (the
    names and IP addresses the SuperNodes and the CLI connect to) and always for localhost and
    127.0.0.1: the SuperLink's own ServerApp connects to it over TLS at its `--host`, which
    flwr 1.41 turns into 127.0.0.1 for `--host 0.0.0.0`. Writes ca.crt, ca.key, server.pem,
    server.key in `out_dir`."""
    hosts = [*hosts, *(h for h in LOOPBACK if h not in hosts)]
    out_dir = Path(out_dir)
    _refuse_existing([out_dir / n for n in ("ca.crt", "ca.key", "server.pem", "server.key")])
    ca_cert, ca_key = _make_ca(days)
    key = ec.generate_private_key(CURVE())
    usage = _key_usage("digital_signature", "key_agreement")
    cert = (
        _certificate(hosts[0], key, ca_cert, ca_key, days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(_san(hosts), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    pem = serialization.Encoding.PEM
    return ServerFiles(
        ca_cert=_write(out_dir / "ca.crt", ca_cert.public_bytes(pem), PUBLIC),
        ca_key=_write(out_dir / "ca.key", _private_pem(ca_key), PRIVATE),
        cert=_write(out_dir / "server.pem", cert.public_bytes(pem), PUBLIC),
        key=_write(out_dir / "server.key", _private_pem(key), PRIVATE),
    )


def public_key_path(private_key: Path) -> Path:
    """Where a SuperNode's public key lies beside its private key (ssh-keygen's `KEY.pub`)."""
    return Path(f"{private_key}.pub")


def make_node_key(private_key: Path) -> tuple[Path, Path]:
    """A SuperNode's P-384 key pair in OpenSSH format: `private_key` (0600, for
    `--auth-supernode-private-key`) and `private_key`.pub (for `flwr supernode register`)."""
    private_key = Path(private_key)
    _refuse_existing([private_key, public_key_path(private_key)])
    key = ec.generate_private_key(CURVE())
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    _write(private_key, private, PRIVATE)
    return private_key, _write(public_key_path(private_key), public + b"\n", PUBLIC)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fedjax_split.deploy.certs",
        description="Keys and certificates for a secured Flower federation (TLS and SuperNode "
        "authentication); see docs/deployment.md. Never overwrites a file.",
    )
    sub = p.add_subparsers(dest="what", required=True)
    server = sub.add_parser("server", help="a CA and the SuperLink's certificate signed by it")
    server.add_argument("out_dir", type=Path, help="writes ca.crt, ca.key, server.pem, server.key")
    server.add_argument("--host", action="append", dest="hosts", default=[], metavar="NAME_OR_IP",
                        help="a name or address the SuperLink is reached at (repeat; localhost "
                        "and 127.0.0.1 are always added)")  # fmt: skip
    server.add_argument("--days", type=int, default=365, help="validity (default 365)")
    node = sub.add_parser("node", help="a SuperNode's key pair (made at its site)")
    node.add_argument("private_key", type=Path, help="writes this file and its .pub")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.what == "server":
            files = make_server(args.out_dir, args.hosts, days=args.days)
            print(f"wrote {files.ca_cert}, {files.cert}, {files.key} and the CA's key "
                  f"{files.ca_key} (keep it offline)")  # fmt: skip
        else:
            private, public = make_node_key(args.private_key)
            print(f"wrote {private} (stays at this site) and {public} (register it)")
    except UserError as err:
        return report(err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
