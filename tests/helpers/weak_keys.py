"""CSRs an attacker might send the CA: keys off the allow-list, and the ones on it.

RSA-512 cannot be generated through `cryptography` (it refuses moduli under 1024 bits), so one
made with `openssl genrsa 512` is kept here; it protects nothing.
"""

from __future__ import annotations

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes

RSA_512_PEM = b"""-----BEGIN PRIVATE KEY-----
MIIBVAIBADANBgkqhkiG9w0BAQEFAASCAT4wggE6AgEAAkEAyAZIzFJxYcPtrpHT
0DYCGtRaAAVCD1jL/UppjehQOXstW2fp3xHzYfJ+UIRAXwKakdVCFjrUlX0umItk
MOufEQIDAQABAkAIWPLKzBn9OX7+zQko5EgcNIZ4/78tAsiojmVvTaWjcGSE4+3Y
bRQ3raeYV9nPNfDv4lL3G294VDalZIalUjUNAiEA/mJ9qi5S8qIzfI2u7pKx4PwY
BSZd5aEMJUEYBH2WbRsCIQDJS234hSKI3kWsfYbGC5z/DbY7ZiNEh1T1WQaa9u1D
QwIgaiERKIT3Gj9Nl7NMvj/5clH6e3uMRRcxiAFmUclLju0CIQC+9x5nLPbsXeI/
l/6qGA5jMcD2bRl8Q99nu4O2tBe3PQIgWPET4Ltt07DbE/t7vIEPaXfflcajDC1J
zIkwY2pfNCk=
-----END PRIVATE KEY-----
"""

# name -> (a key factory, the words the CA's refusal must contain)
REFUSED_KEYS = {
    "rsa-512": (lambda: serialization.load_pem_private_key(RSA_512_PEM, None), "512 bits"),
    "rsa-1024": (lambda: rsa.generate_private_key(65537, 1024), "1024 bits"),
    "rsa-2048-e3": (lambda: rsa.generate_private_key(3, 2048), "public exponent 3"),
    "p-192": (lambda: ec.generate_private_key(ec.SECP192R1()), "curve secp192r1"),
    "secp256k1": (lambda: ec.generate_private_key(ec.SECP256K1()), "curve secp256k1"),
}
ACCEPTED_KEYS = {
    "rsa-2048": lambda: rsa.generate_private_key(65537, 2048),
    "p-256": lambda: ec.generate_private_key(ec.SECP256R1()),
    "p-384": lambda: ec.generate_private_key(ec.SECP384R1()),
    "ed25519": lambda: ed25519.Ed25519PrivateKey.generate(),
}


def csr_pem(key: CertificateIssuerPrivateKeyTypes) -> bytes:
    """A CSR signed by `key` (so its signature is valid; only the key itself is at issue)."""
    algorithm = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    csr = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([])).sign(key, algorithm)
    return csr.public_bytes(serialization.Encoding.PEM)
