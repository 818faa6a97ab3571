"""The control plane's CA: `istio.v1.auth.IstioCertificateService` with node authorization.

Counterparts: istiod security/pkg/server/ca/server.go (`CreateCertificate`), node_auth.go (who
may ask for someone else's certificate) and authenticate/kubeauth (bearer token and
`clusterid`). Authentication is one awaited call (`CaServer.authenticate`: a TokenReview, or our
own token check); the decision after it is pure (`CaServer.decide`, `authorize`); the gRPC
servicer only reads the call, signs what the decision allows and answers.

Rules carried over from istiod:
- the caller is who its service-account token says (tokenreview.py: a TokenReview with
  audience `istio-ca` when the control plane reads the API server; tokens.py: the tokens it
  minted itself with `--dir`); without `ImpersonatedIdentity` the certificate is for the
  caller's own identity, whatever the CSR asks for;
- impersonation (ztunnel in shared mode asking for the workloads it serves; node_auth.go) only
  for callers listed in CA_TRUSTED_NODE_ACCOUNTS, holding a token bound to a pod that still
  exists with the same UID and service account; the caller's node is that pod's
  `spec.nodeName`, and the requested identity must be the service account of some pod on that
  node;
- a `clusterid` that is neither empty nor ours is refused: we hold no other cluster's view;
- lifetime <= 0 means the default (24 h), and no lifetime exceeds the maximum (90 days).

Difference, on purpose: istiod answers an impersonation failure with the bare wording
"request impersonation authentication failure" and keeps the detail in its log; we append the
detail, because the callers are our own node proxies and the operator reading their log is the
one who must fix it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import grpc
from google.protobuf import json_format

from ..errors import CertificateError, IdentityError
from ..identity.ca import DEFAULT_WORKLOAD_CERT_TTL_S, MAX_WORKLOAD_CERT_TTL_S, CertificateAuthority
from ..identity.spiffe import Identity
from ..wire.istio.v1.auth import ca_pb2, ca_pb2_grpc
from .tokenreview import Authenticator
from .tokens import AuthenticationError, Caller, parse_account

log = logging.getLogger(__name__)

IMPERSONATED_IDENTITY = "ImpersonatedIdentity"
AUTHORIZATION_HEADER = "authorization"
BEARER_PREFIX = "Bearer "
CLUSTER_ID_HEADER = "clusterid"
DEFAULT_CLUSTER_ID = "Kubernetes"
# The Helm chart's CA_TRUSTED_NODE_ACCOUNTS: only ztunnel's service account may impersonate.
DEFAULT_TRUSTED_NODE_ACCOUNTS = frozenset({"istio-system/ztunnel"})

# istiod's wording, so operators can search for it.
AUTHENTICATE_FAILURE = "request authenticate failure"
IMPERSONATION_FAILURE = "request impersonation authentication failure"


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundPod:
    """What node authorization needs of the pod a token is bound to."""

    uid: str
    service_account: str
    node_name: str


class NodeIndex(Protocol):
    """The control plane's view of pods (istiod: its pod lister and node+sa index)."""

    def bound_pod(self, namespace: str, name: str) -> BoundPod | None: ...

    def identities_on_node(self, node: str) -> set[Identity]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Refusal:
    """Why a certificate is not issued; `impersonation` picks istiod's summary line."""

    reason: str
    impersonation: bool = False

    @property
    def message(self) -> str:
        return f"{IMPERSONATION_FAILURE if self.impersonation else AUTHENTICATE_FAILURE}: {self.reason}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Issuance:
    """The plan for one request: sign the CSR for `identity`, valid for `ttl_s`."""

    identity: Identity
    ttl_s: int
    caller: Caller


# --- pure pieces ------------------------------------------------------------------------------


def bearer_token(metadata: Iterable[tuple[str, Any]]) -> str | Refusal:
    """The token of the first `authorization: Bearer <token>` entry of the call metadata."""
    values = [v for k, v in metadata if k.lower() == AUTHORIZATION_HEADER]
    if not values:
        return Refusal(reason="no authorization header; send 'authorization: Bearer <service account token>'")
    for value in values:
        if isinstance(value, str) and value.startswith(BEARER_PREFIX):
            token = value[len(BEARER_PREFIX) :].strip()
            if token:
                return token
            return Refusal(reason="the authorization header holds an empty bearer token")
    return Refusal(reason="the authorization header is not 'Bearer <token>'")


def check_cluster_id(metadata: Iterable[tuple[str, Any]], cluster_id: str) -> Refusal | None:
    """istiod: an empty or absent `clusterid` means its own cluster; another id it must know."""
    values = [v for k, v in metadata if k.lower() == CLUSTER_ID_HEADER]
    # istiod reads the header only when it has exactly one value.
    sent = values[0] if len(values) == 1 else ""
    if sent in ("", cluster_id):
        return None
    return Refusal(reason=f"unknown cluster {sent!r}; this control plane serves cluster {cluster_id!r}")


def requested_identity(metadata: Mapping[str, Any]) -> Identity | Refusal | None:
    """`ImpersonatedIdentity` from the request's metadata Struct (as a dict); None when absent."""
    value = metadata.get(IMPERSONATED_IDENTITY)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        return Refusal(reason=f"{IMPERSONATED_IDENTITY} is not a string", impersonation=True)
    try:
        return Identity.parse(value)
    except IdentityError as e:
        return Refusal(reason=f"failed to validate impersonated identity: {e.message}", impersonation=True)


def parse_trusted_node_accounts(text: str) -> frozenset[str]:
    """istiod's CA_TRUSTED_NODE_ACCOUNTS: comma-separated `namespace/serviceaccount` entries."""
    accounts = set()
    for entry in text.split(","):
        if entry.strip():
            namespace, account = parse_account(entry.strip())
            accounts.add(f"{namespace}/{account}")
    return frozenset(accounts)


def certificate_ttl_s(requested_s: int, *, default_s: int, max_s: int) -> int:
    """istiod: <= 0 asks for the default; nothing longer than the maximum."""
    return default_s if requested_s <= 0 else min(requested_s, max_s)


def authorize(
    caller: Caller,
    requested: Identity | None,
    node_index: NodeIndex,
    trusted: frozenset[str],
    trust_domain: str,
) -> Identity | Refusal:
    """Whose certificate `caller` may have: its own, or (node proxies) one running on its node."""
    if requested is None:
        # A pod-bound token whose pod is gone is no longer valid (a TokenReview would say so).
        if caller.pod_name is not None:
            pod = node_index.bound_pod(caller.namespace, caller.pod_name)
            if pod is None or pod.uid != caller.pod_uid:
                return Refusal(
                    reason=f"the token's pod {caller.namespace}/{caller.pod_name} no longer exists"
                )
        return caller.identity(trust_domain)

    def refuse(reason: str) -> Refusal:
        return Refusal(reason=reason, impersonation=True)

    if caller.account not in trusted:
        return refuse(
            f"caller {caller.account} is not allowed to impersonate "
            f"(CA_TRUSTED_NODE_ACCOUNTS: {', '.join(sorted(trusted)) or 'none'})"
        )
    if requested.trust_domain != trust_domain:
        return refuse(f"{requested} is not in this mesh's trust domain {trust_domain!r}")
    if caller.pod_name is None or caller.pod_uid is None:
        return refuse(f"caller {caller.account} holds a token that is not bound to a pod")
    pod = node_index.bound_pod(caller.namespace, caller.pod_name)
    if pod is None:
        return refuse(f"failed to look up the caller's pod {caller.namespace}/{caller.pod_name}: not found")
    if pod.uid != caller.pod_uid:
        # A pod re-created under the same name has a new UID; the old token is stale.
        return refuse(
            f"pod {caller.namespace}/{caller.pod_name} found, but its UID {pod.uid} is not the token's "
            f"{caller.pod_uid}"
        )
    if pod.service_account != caller.service_account:
        return refuse(
            f"pod {caller.namespace}/{caller.pod_name} runs as {pod.service_account}, "
            f"not the token's {caller.service_account}"
        )
    if not pod.node_name:
        return refuse(f"the caller's pod {caller.namespace}/{caller.pod_name} is not scheduled to a node")
    if requested not in node_index.identities_on_node(pod.node_name):
        return refuse(f"no workload running as {requested} on node {pod.node_name!r}")
    return requested


# --- the service ------------------------------------------------------------------------------


class CaServer(ca_pb2_grpc.IstioCertificateServiceServicer):
    """IstioCertificateService: authenticate the token, authorize the identity, sign the CSR."""

    def __init__(
        self,
        ca: CertificateAuthority,
        authenticator: Authenticator,
        *,
        trust_domain: str,
        node_index: NodeIndex,
        trusted_node_accounts: frozenset[str] = DEFAULT_TRUSTED_NODE_ACCOUNTS,
        cluster_id: str = DEFAULT_CLUSTER_ID,
        default_ttl_s: int = DEFAULT_WORKLOAD_CERT_TTL_S,
        max_ttl_s: int = MAX_WORKLOAD_CERT_TTL_S,
        clock: Callable[[], float] = time.time,
        precheck_in_full: bool = False,
    ) -> None:
        self.ca = ca
        self.precheck_in_full = precheck_in_full
        self.authenticator = authenticator
        self.trust_domain = trust_domain
        self.node_index = node_index
        self.trusted_node_accounts = frozenset(trusted_node_accounts)
        self.cluster_id = cluster_id
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self._clock = clock
        self.issued = 0
        self.refused = 0

    def __repr__(self) -> str:
        return (
            f"CaServer(trust domain {self.trust_domain!r}, cluster {self.cluster_id!r}, "
            f"{self.issued} issued, {self.refused} refused)"
        )

    def register(self, server: grpc.aio.Server) -> None:
        # generated by grpcio-tools (wire/regenerate.py), which writes no annotations
        ca_pb2_grpc.add_IstioCertificateServiceServicer_to_server(self, server)  # type: ignore[no-untyped-call]

    async def authenticate(self, call_metadata: Iterable[tuple[str, Any]], now: float) -> Caller | Refusal:
        """Who calls: the bearer token, checked by the authenticator, for our cluster."""
        call_metadata = list(call_metadata)
        token = bearer_token(call_metadata)
        if isinstance(token, Refusal):
            return token
        refusal = check_cluster_id(call_metadata, self.cluster_id)
        if refusal is not None:
            return refusal
        try:
            return await self.authenticator.authenticate(token, now)
        except AuthenticationError as e:
            return Refusal(reason=e.reason)

    async def precheck(self, call_metadata: Iterable[tuple[str, Any]]) -> str | None:
        """caller_gate's check, made when a call's headers arrive and before its body is read:
        a bearer token for our cluster, verified in full when `precheck_in_full` (our own
        tokens, checked locally). None lets the call through; a string says why not."""
        call_metadata = list(call_metadata)
        if not self.precheck_in_full:
            token = bearer_token(call_metadata)
            if isinstance(token, Refusal):
                return token.message
            refusal = check_cluster_id(call_metadata, self.cluster_id)
            return None if refusal is None else refusal.message
        caller = await self.authenticate(call_metadata, self._clock())
        return caller.message if isinstance(caller, Refusal) else None

    def decide(self, caller: Caller, request: ca_pb2.IstioCertificateRequest) -> Issuance | Refusal:
        """Pure: for which identity the authenticated caller gets a certificate, for how long."""
        requested = requested_identity(
            json_format.MessageToDict(request.metadata) if request.HasField("metadata") else {}
        )
        if isinstance(requested, Refusal):
            return requested
        identity = authorize(
            caller, requested, self.node_index, self.trusted_node_accounts, self.trust_domain
        )
        if isinstance(identity, Refusal):
            return identity
        ttl_s = certificate_ttl_s(
            request.validity_duration, default_s=self.default_ttl_s, max_s=self.max_ttl_s
        )
        return Issuance(identity=identity, ttl_s=ttl_s, caller=caller)

    async def plan(
        self, call_metadata: Iterable[tuple[str, Any]], request: ca_pb2.IstioCertificateRequest, now: float
    ) -> Issuance | Refusal:
        """Everything short of signing."""
        caller = await self.authenticate(call_metadata, now)
        return caller if isinstance(caller, Refusal) else self.decide(caller, request)

    async def CreateCertificate(  # noqa: N802 - the generated servicer's method name
        self,
        request: ca_pb2.IstioCertificateRequest,
        context: grpc.aio.ServicerContext[ca_pb2.IstioCertificateRequest, ca_pb2.IstioCertificateResponse],
    ) -> ca_pb2.IstioCertificateResponse:
        now = self._clock()
        peer = context.peer()
        plan = await self.plan(context.invocation_metadata() or (), request, now)
        if isinstance(plan, Refusal):
            self.refused += 1
            log.warning("certificate refused", extra={"fields": {"peer": peer, "reason": plan.message}})
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, plan.message)
        assert isinstance(plan, Issuance)
        at = datetime.fromtimestamp(now, UTC)
        signer = self.ca.signing_cert
        if not signer.not_valid_before_utc <= at < signer.not_valid_after_utc:
            self.refused += 1
            log.error(
                "CA signing certificate is not valid now",
                extra={
                    "fields": {
                        "not_before": str(signer.not_valid_before_utc),
                        "not_after": str(signer.not_valid_after_utc),
                    }
                },
            )
            await context.abort(
                grpc.StatusCode.INTERNAL, "CSR signing error: the CA's signing certificate is not valid now"
            )
        try:
            chain = self.ca.sign_csr(request.csr.encode(), plan.identity, plan.ttl_s, now=at)
        except (CertificateError, UnicodeError) as e:
            self.refused += 1
            log.warning(
                "CSR refused",
                extra={"fields": {"peer": peer, "identity": str(plan.identity), "error": str(e)}},
            )
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"CSR signing error ({e})")
        self.issued += 1
        log.info(
            "certificate issued",
            extra={
                "fields": {
                    "identity": str(plan.identity),
                    "caller": plan.caller.account,
                    "pod": plan.caller.pod_name or "",
                    "node": plan.caller.node or "",
                    "ttl_s": plan.ttl_s,
                    "peer": peer,
                }
            },
        )
        return ca_pb2.IstioCertificateResponse(cert_chain=chain)
