"""Python's own `ssl` contexts for a workload certificate, as HBONE peers in tests: the system
OpenSSL that `_ssl` links, a TLS stack other than the node proxy's (tls/, pyOpenSSL on
cryptography's OpenSSL). TLS 1.3, ALPN h2, mutual certificates under the CA's roots, no hostname
check, as HBONE asks. The key goes through a file in a private temporary directory because
`ssl` loads keys from paths only; that is test code, never the proxy's."""

from __future__ import annotations

import ssl
import tempfile
from pathlib import Path

from ambient_mesh.identity import WorkloadCertificate


def _load(ctx: ssl.SSLContext, cert: WorkloadCertificate) -> ssl.SSLContext:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols(["h2"])
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=cert.roots_pem.decode("ascii"))
    with tempfile.TemporaryDirectory(prefix="tls-stdlib-") as directory:
        path = Path(directory) / "chain.pem"
        path.write_bytes(cert.private_key_pem + b"".join(cert.chain_pem))
        ctx.load_cert_chain(path)
    return ctx


def stdlib_client_context(cert: WorkloadCertificate) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    return _load(ctx, cert)


def stdlib_server_context(cert: WorkloadCertificate) -> ssl.SSLContext:
    return _load(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), cert)
