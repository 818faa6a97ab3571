"""Workload identity: SPIFFE ids, certificates, the embedded CA, the SecretManager, HBONE TLS.

Counterpart: ztunnel src/identity/ and src/tls/.
"""

from .ca import CaClient, CertificateAuthority, EmbeddedCaClient
from .certificate import WorkloadCertificate, generate_csr, spiffe_ids
from .manager import CertificateState, Priority, SecretManager
from .spiffe import Identity
from .tls import (
    TlsContextCache,
    client_context,
    require_h2,
    server_context,
    verify_client_identity,
    verify_server_identity,
)

__all__ = [
    "CaClient",
    "CertificateAuthority",
    "CertificateState",
    "EmbeddedCaClient",
    "Identity",
    "Priority",
    "SecretManager",
    "TlsContextCache",
    "WorkloadCertificate",
    "client_context",
    "generate_csr",
    "require_h2",
    "server_context",
    "spiffe_ids",
    "verify_client_identity",
    "verify_server_identity",
]
