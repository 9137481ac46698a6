"""TLS on the TCP listener through grpc's own credentials, with a CA made in the test:
tokens are accepted over TLS and refused over plaintext TCP unless the operator says so;
with a client CA, a client without a certificate cannot even connect (mTLS)."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import subprocess
import sys

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvd_client import AsyncClient, Tls, UnauthenticatedError, UnavailableError, pb
from kvd_loadgen.local import LocalKvd


def _cert(name: str, key, issuer_name, issuer_key, *, ca=False, ip=None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(issuer_name or x509.Name(
                   [x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(hours=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ip:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
            critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("kvd test CA", ca_key, None, ca_key, ca=True)
    files = {"ca.pem": ca.public_bytes(serialization.Encoding.PEM)}
    for name, ip in (("server", "127.0.0.1"), ("client", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(name, key, ca.subject, ca_key, ip=ip)
        files[f"{name}.pem"] = cert.public_bytes(serialization.Encoding.PEM)
        files[f"{name}.key"] = key.private_bytes(serialization.Encoding.PEM,
                                                 serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption())
    for name, data in files.items():
        (d / name).write_bytes(data)
    return d


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONFIG = """
[server]
tcp = "127.0.0.1:{port}"
{tls}

[auth]
admin_token = "root-token"

[[pool]]
model = "tiny"
device_pages = 8
host_pages = 8

[[tenant]]
name = "alpha"
token = "alpha-token"
"""


def _start(tmp_path, tls: str):
    port = _port()
    config = tmp_path / "kvd.toml"
    config.write_text(CONFIG.format(port=port, tls=tls))
    return LocalKvd("--config", str(config), workdir=tmp_path), f"127.0.0.1:{port}"


async def test_tokens_travel_over_tls(tmp_path, pki):
    tls = f'tls_cert = "{pki}/server.pem"\ntls_key = "{pki}/server.key"'
    kvd, address = _start(tmp_path, tls)
    with kvd:
        async with AsyncClient(address, token="alpha-token", tls=Tls(ca=f"{pki}/ca.pem"),
                               timeout_s=5) as alpha:
            assert (await alpha.admit("r", 16)).decision == pb.DECISION_ADMITTED
        # A plaintext client cannot talk to a TLS listener at all.
        async with AsyncClient(address, token="alpha-token", timeout_s=2) as plain:
            with pytest.raises(UnavailableError):
                await plain.admit("r2", 16)
        # kvctl takes the same options.
        out = subprocess.run([sys.executable, "-m", "kvd_client.kvctl", "--target", address,
                              "--token", "root-token", "--tls-ca", f"{pki}/ca.pem",
                              "status", "--json"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr


async def test_tokens_over_plaintext_tcp_are_refused_unless_allowed(tmp_path):
    kvd, address = _start(tmp_path, "")
    with kvd:
        async with AsyncClient(address, token="alpha-token", timeout_s=5) as alpha:
            with pytest.raises(UnauthenticatedError, match="plaintext TCP are refused"):
                await alpha.admit("r", 16)
    (tmp_path / "more").mkdir()
    kvd, address = _start(tmp_path / "more", "allow_plaintext_tokens = true")
    with kvd:
        async with AsyncClient(address, token="alpha-token", timeout_s=5) as alpha:
            assert (await alpha.admit("r", 16)).decision == pb.DECISION_ADMITTED


async def test_mtls_wants_a_client_certificate(tmp_path, pki):
    tls = (f'tls_cert = "{pki}/server.pem"\ntls_key = "{pki}/server.key"\n'
           f'tls_client_ca = "{pki}/ca.pem"')
    kvd, address = _start(tmp_path, tls)
    with kvd:
        mutual = Tls(ca=f"{pki}/ca.pem", cert=f"{pki}/client.pem", key=f"{pki}/client.key")
        async with AsyncClient(address, token="alpha-token", tls=mutual, timeout_s=5) as ok:
            assert (await ok.admit("r", 16)).decision == pb.DECISION_ADMITTED
        async with AsyncClient(address, token="alpha-token", tls=Tls(ca=f"{pki}/ca.pem"),
                               timeout_s=2) as anonymous:
            with pytest.raises(UnavailableError):
                await anonymous.admit("r2", 16)
