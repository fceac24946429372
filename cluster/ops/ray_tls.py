"""Ray's own mutual TLS (`ray.tls`): every gRPC server Ray runs (GCS, raylets, workers, and each Serve
replica's inter-deployment server, which Ray Serve 2.60 binds to `[::]:0`) asks for a certificate
signed by the cluster's CA, and every Ray client presents one.

Ray reads four variables (`ray._common.tls_utils`): RAY_USE_TLS, and the PEM files
RAY_TLS_SERVER_CERT, RAY_TLS_SERVER_KEY, RAY_TLS_CA_CERT. The same node certificate serves and
dials, so it carries both key usages; Ray's clients dial addresses, so it names the node's address
(and loopback) as IP SANs.

- A local cluster (`specserve up`): with `ray.tls.ca_cert` unset, a CA is made for this start in a
  private folder and forgotten at the next; the node certificate is signed by it. With the CA's
  certificate and key configured, the node certificate is signed by that CA.
- Kubernetes (`cluster/k8s/rayservice.py`): the CA comes from a Secret, and an init container of every
  Ray pod runs `python -m cluster.ops.ray_tls node-cert` to sign one for the pod's address.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

USE, CERT, KEY, CA = "RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT"
NODE_DAYS = 30  # a node certificate outlives any one start of a local cluster, and a pod


@dataclass(frozen=True)
class NodePki:
    ca_cert: Path
    cert: Path
    key: Path

    def env(self) -> dict[str, str]:
        """Ray's variables for this node."""
        return {USE: "1", CERT: str(self.cert), KEY: str(self.key), CA: str(self.ca_cert)}


def ray_tls_env(environ: dict) -> dict[str, str]:
    """The Ray TLS variables of `environ` (set when Ray's TLS is on): what a client attaching to the
    cluster needs too.

    >>> ray_tls_env({"RAY_USE_TLS": "1", "RAY_TLS_CA_CERT": "/c", "PATH": "/bin"})
    {'RAY_USE_TLS': '1', 'RAY_TLS_CA_CERT': '/c'}
    >>> ray_tls_env({"RAY_USE_TLS": "0", "RAY_TLS_CA_CERT": "/c"})
    {}
    """
    if environ.get(USE, "0").lower() not in ("1", "true"):
        return {}
    return {k: environ[k] for k in (USE, CERT, KEY, CA) if k in environ}


def _sans(hosts: Sequence[str]):
    from cryptography import x509

    out, seen = [], set()
    for h in hosts:
        if not h or h in seen:
            continue
        seen.add(h)
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def _write_key(path: Path, key) -> None:
    from cryptography.hazmat.primitives import serialization

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))


def make_ca(folder: Path, name: str = "specserve Ray CA", days: int = NODE_DAYS) -> tuple[Path, Path]:
    """A new CA (P-256) in `folder`: (certificate, key); the key readable by its owner only."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write_key(folder / "ca.key", key)
    (folder / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return folder / "ca.crt", folder / "ca.key"


def node_cert(folder: Path, ca_cert: Path, ca_key: Path, hosts: Sequence[str], days: int = NODE_DAYS) -> NodePki:
    """A node certificate for `hosts` (addresses and names; loopback is always added) signed by the
    CA, for serving and dialling, in `folder` (tls.crt, tls.key, and a copy of the CA's certificate:
    the node needs no access to the CA's key afterwards)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca = x509.load_pem_x509_certificate(Path(ca_cert).read_bytes())
    signer = serialization.load_pem_private_key(Path(ca_key).read_bytes(), password=None)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    names = [*hosts, "127.0.0.1", "::1", "localhost"]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(_sans(names)), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()), critical=False)
            .sign(signer, hashes.SHA256()))
    _write_key(folder / "tls.key", key)
    (folder / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "ca.crt").write_bytes(Path(ca_cert).read_bytes())
    return NodePki(folder / "ca.crt", folder / "tls.crt", folder / "tls.key")


def local_pki(hosts: Sequence[str], ca_cert: Optional[str] = None, ca_key: Optional[str] = None,
              base: Optional[Path] = None) -> NodePki:
    """The node certificate of a local cluster in a new private folder: signed by the configured CA,
    or by a CA made for this start (its key deleted once the node certificate is signed, so nothing
    else can be signed by it)."""
    folder = Path(tempfile.mkdtemp(prefix="specserve-ray-tls-", dir=base))
    if ca_cert and ca_key:
        return node_cert(folder, Path(ca_cert), Path(ca_key), hosts)
    cert, key = make_ca(folder / "ca")
    pki = node_cert(folder, cert, key, hosts)
    key.unlink()
    return pki


def forget_local_pki(environ: dict) -> None:
    """Delete the folder `local_pki` made (named by RAY_TLS_SERVER_CERT), once its Ray is stopped."""
    cert = environ.get(CERT)
    if cert and Path(cert).parent.name.startswith("specserve-ray-tls-"):
        shutil.rmtree(Path(cert).parent, ignore_errors=True)


def routable_address() -> str:
    """This machine's address as Ray picks it when ray.node_ip_address is unset."""
    from ray._common.network_utils import node_ip_address_from_perspective

    return node_ip_address_from_perspective()


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m cluster.ops.ray_tls node-cert --ca-dir D --out O --host IP ...`: the init container of
    a Ray pod (the CA's Secret mounted at D with ca.crt and ca.key); prints Ray's variables."""
    ap = argparse.ArgumentParser(prog="python -m cluster.ops.ray_tls")
    sub = ap.add_subparsers(dest="cmd", required=True)
    nc = sub.add_parser("node-cert", help="sign a node certificate with the CA in --ca-dir")
    nc.add_argument("--ca-dir", required=True, type=Path)
    nc.add_argument("--out", required=True, type=Path)
    nc.add_argument("--host", action="append", default=[], help="the node's address or name (repeatable)")
    args = ap.parse_args(argv)
    missing = [f for f in ("ca.crt", "ca.key") if not (args.ca_dir / f).is_file()]
    if missing:
        print(f"ray_tls: --ca-dir {args.ca_dir}: missing {', '.join(missing)}", file=sys.stderr)
        return 2
    pki = node_cert(args.out, args.ca_dir / "ca.crt", args.ca_dir / "ca.key", args.host)
    for k, v in pki.env().items():
        print(f"{k}={v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
