"""Workload identity: SPIFFE ids, certificates, the embedded CA, the SecretManager (HBONE's TLS
is the `tls` package, which builds on this one).

Counterpart: ztunnel src/identity/.
"""

from .ca import CaClient, CertificateAuthority, EmbeddedCaClient
from .certificate import WorkloadCertificate, generate_csr, spiffe_ids
from .manager import CertificateState, Priority, SecretManager
from .spiffe import Identity

__all__ = [
    "CaClient",
    "CertificateAuthority",
    "CertificateState",
    "EmbeddedCaClient",
    "Identity",
    "Priority",
    "SecretManager",
    "WorkloadCertificate",
    "generate_csr",
    "spiffe_ids",
]
