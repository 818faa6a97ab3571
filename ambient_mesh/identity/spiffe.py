"""SPIFFE identities as Istio uses them: `spiffe://<trust domain>/ns/<namespace>/sa/<account>`.

Counterpart: ztunnel src/identity.rs (`Identity::Spiffe`). Parsing requires exactly that
five-segment shape; anything else is an IdentityError.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import IdentityError

SPIFFE_SCHEME = "spiffe://"
DEFAULT_TRUST_DOMAIN = "cluster.local"
DEFAULT_SERVICE_ACCOUNT = "default"


@dataclass(frozen=True, slots=True, order=True)
class Identity:
    trust_domain: str
    namespace: str
    service_account: str

    def __post_init__(self) -> None:
        for name in ("trust_domain", "namespace", "service_account"):
            value = getattr(self, name)
            if not value or "/" in value:
                raise IdentityError(f"SPIFFE {name.replace('_', ' ')} {value!r} is empty or contains '/'")

    def __str__(self) -> str:
        return f"{SPIFFE_SCHEME}{self.trust_domain}/ns/{self.namespace}/sa/{self.service_account}"

    @property
    def principal(self) -> str:
        """The id without `spiffe://`, as Istio authorization policies name principals."""
        return str(self)[len(SPIFFE_SCHEME) :]

    @classmethod
    def parse(cls, uri: str) -> Identity:
        if not uri.startswith(SPIFFE_SCHEME):
            raise IdentityError(f"{uri!r} is not a SPIFFE id: it must start with {SPIFFE_SCHEME}")
        parts = uri[len(SPIFFE_SCHEME) :].split("/")
        if len(parts) != 5 or parts[1] != "ns" or parts[3] != "sa":
            raise IdentityError(
                f"{uri!r} is not of the form spiffe://<trust domain>/ns/<namespace>/sa/<account>"
            )
        return cls(parts[0], parts[2], parts[4])

    @classmethod
    def for_workload(cls, *, trust_domain: str, namespace: str, service_account: str) -> Identity:
        """Identity of a workload record, with Istio's defaults for empty fields."""
        return cls(
            trust_domain or DEFAULT_TRUST_DOMAIN, namespace, service_account or DEFAULT_SERVICE_ACCOUNT
        )
