"""TLS for the control plane's gRPC port (15012): its serving certificate and the credentials.

Counterpart: istiod's own DNS certificate (pilot/pkg/bootstrap: `istiod.istio-system.svc`,
signed by the mesh CA) that node proxies verify against the mesh root, and the client side of
ztunnel's control-plane channel (src/identity/caclient.rs, src/xds/client.rs). The xDS server
and client reuse these helpers.

The workload CA signs only SPIFFE URI SANs (as istiod's CreateCertificate does), so the serving
certificate, which also needs DNS and IP SANs for the proxies' hostname check, is built here
with the CA's signing key.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from ..errors import CertificateError
from .ca import CertificateAuthority
from .certificate import WorkloadCertificate
from .spiffe import Identity

ISTIOD_NAMESPACE = "istio-system"
ISTIOD_SERVICE_ACCOUNT = "istiod"
DEFAULT_SERVING_DNS_NAMES = ("istiod.istio-system.svc", "localhost")
DEFAULT_SERVING_IPS = ("127.0.0.1",)
DEFAULT_SERVING_TTL_S = 365 * 86400

MIB = 1024 * 1024
# ztunnel raises the receive limit to 200 MiB: a full-state xDS push is large
# (docs/istio-behaviour.md, "Delta xDS").
MAX_RECEIVE_MESSAGE_BYTES = 200 * MIB
# docs/istio-behaviour.md, "Delta xDS": HTTP/2 PING every 30 s, 10 s to answer.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000


def serving_certificate(
    ca: CertificateAuthority,
    dns_names: Sequence[str],
    ip_addresses: Iterable[str],
    ttl_s: int,
    now: datetime,
    *,
    trust_domain: str = "cluster.local",
) -> WorkloadCertificate:
    """istiod's serving certificate: its SPIFFE id plus the names proxies dial it by.

    Defaults worth passing: DEFAULT_SERVING_DNS_NAMES, DEFAULT_SERVING_IPS, DEFAULT_SERVING_TTL_S.
    """
    identity = Identity(trust_domain, ISTIOD_NAMESPACE, ISTIOD_SERVICE_ACCOUNT)
    key = ec.generate_private_key(ec.SECP256R1())
    try:
        sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(str(identity))]
        sans += [x509.DNSName(name) for name in dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    except ValueError as e:
        raise CertificateError(f"serving certificate name is not usable: {e}") from e
    signer = ca.signing_cert
    not_after = min(now + timedelta(seconds=ttl_s), signer.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(signer.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(not_after)
        # Critical because the subject is empty (RFC 5280 section 4.2.1.6).
        .add_extension(x509.SubjectAlternativeName(sans), critical=True)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=True,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
        .sign(ca.signing_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    chain = [
        cert.public_bytes(pem).decode(),
        *(c.public_bytes(pem).decode() for c in ca.intermediates),
        ca.root_pem.decode(),
    ]
    # The same checks as for a workload certificate: key matches, chain reaches the root.
    return WorkloadCertificate.from_ca_response(identity, key_pem, chain)


def server_credentials(cert: WorkloadCertificate) -> grpc.ServerCredentials:
    """TLS without client certificates: callers prove who they are with a bearer token."""
    return grpc.ssl_server_credentials([(cert.private_key_pem, b"".join(cert.chain_pem))])


def channel_credentials(root_pem: bytes | None) -> grpc.ChannelCredentials:
    """Verify the control plane against `root_pem` (None: gRPC's default roots, i.e. SYSTEM)."""
    return grpc.ssl_channel_credentials(root_certificates=root_pem)


def channel_options(alt_hostname: str | None = None) -> list[tuple[str, int | str]]:
    """gRPC channel options for the control-plane channel (docs/istio-behaviour.md,
    "Delta xDS": limits and keepalive).

    `alt_hostname` (ALT_CA_HOSTNAME / ALT_XDS_HOSTNAME) is the name checked against the
    server's certificate. gRPC replaces the target host with it, where ztunnel accepts
    either name: set it only when the dialled host is not in the certificate.
    """
    options: list[tuple[str, int | str]] = [
        ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ]
    if alt_hostname:
        options.append(("grpc.ssl_target_name_override", alt_hostname))
    return options
