"""The CA server's decision, without gRPC: who may have which certificate, and why not."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from google.protobuf import struct_pb2
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.control.ca_server import (
    DEFAULT_TRUSTED_NODE_ACCOUNTS,
    BoundPod,
    CaServer,
    Issuance,
    Refusal,
    authorize,
    bearer_token,
    certificate_ttl_s,
    check_cluster_id,
    parse_trusted_node_accounts,
    requested_identity,
)
from ambient_mesh.control.tokens import Caller, TokenIssuer
from ambient_mesh.errors import ConfigError
from ambient_mesh.identity import CertificateAuthority, Identity
from ambient_mesh.wire.istio.v1.auth import ca_pb2

TD = "cluster.local"
NOW = 1_900_000_000.0
ZTUNNEL = Caller(
    namespace="istio-system", service_account="ztunnel", pod_name="ztunnel-a", pod_uid="uid-a", node="node-1"
)
APP = Identity(TD, "ns1", "app")
ELSEWHERE = Identity(TD, "ns2", "db")


@dataclass
class FakeNodeIndex:
    """Pods by node, as the control plane's Kubernetes view would answer; records each question."""

    nodes: dict[str, set[Identity]] = field(default_factory=dict)
    pods: dict[tuple[str, str], BoundPod] = field(default_factory=dict)
    asked: list[str] = field(default_factory=list)

    def identities_on_node(self, node: str) -> set[Identity]:
        self.asked.append(f"node {node}")
        return set(self.nodes.get(node, set()))

    def bound_pod(self, namespace: str, name: str) -> BoundPod | None:
        self.asked.append(f"pod {namespace}/{name}")
        return self.pods.get((namespace, name))


def index() -> FakeNodeIndex:
    return FakeNodeIndex(
        nodes={"node-1": {APP, Identity(TD, "istio-system", "ztunnel")}, "node-2": {ELSEWHERE}},
        pods={
            ("istio-system", "ztunnel-a"): BoundPod(
                uid="uid-a", service_account="ztunnel", node_name="node-1"
            ),
            ("ns1", "app-1"): BoundPod(uid="uid-app", service_account="app", node_name="node-1"),
        },
    )


def decide(
    caller: Caller, requested: Identity | None, idx: FakeNodeIndex | None = None
) -> Identity | Refusal:
    return authorize(caller, requested, idx or index(), DEFAULT_TRUSTED_NODE_ACCOUNTS, TD)


# --- authorize ----------------------------------------------------------------------------------


def test_without_impersonation_the_caller_gets_its_own_identity() -> None:
    app = Caller(namespace="ns1", service_account="app", pod_name="app-1", pod_uid="uid-app", node="node-1")
    assert decide(app, None) == APP
    # An unbound token (e.g. minted by `ambient control token`) names only the account.
    assert decide(Caller(namespace="ns9", service_account="x"), None) == Identity(TD, "ns9", "x")


def test_own_identity_is_refused_when_the_tokens_pod_is_gone() -> None:
    gone = Caller(namespace="ns1", service_account="app", pod_name="app-1", pod_uid="old-uid", node="node-1")
    result = decide(gone, None)
    assert result == Refusal(reason="the token's pod ns1/app-1 no longer exists")
    assert result.message == "request authenticate failure: the token's pod ns1/app-1 no longer exists"


def test_node_proxy_may_impersonate_a_workload_on_its_node() -> None:
    idx = index()
    assert decide(ZTUNNEL, APP, idx) == APP
    assert idx.asked == ["pod istio-system/ztunnel-a", "node node-1"]


def refusal(caller: Caller, requested: Identity, idx: FakeNodeIndex | None = None) -> str:
    result = decide(caller, requested, idx)
    assert isinstance(result, Refusal)
    assert result.impersonation
    assert result.message.startswith("request impersonation authentication failure: ")
    return result.reason


def test_identity_on_another_node_is_refused() -> None:
    assert refusal(ZTUNNEL, ELSEWHERE) == f"no workload running as {ELSEWHERE} on node 'node-1'"


def test_untrusted_caller_may_not_impersonate_even_its_neighbours() -> None:
    app = Caller(namespace="ns1", service_account="app", pod_name="app-1", pod_uid="uid-app", node="node-1")
    idx = index()
    reason = refusal(app, Identity(TD, "istio-system", "ztunnel"), idx)
    assert (
        reason
        == "caller ns1/app is not allowed to impersonate (CA_TRUSTED_NODE_ACCOUNTS: istio-system/ztunnel)"
    )
    assert idx.asked == []  # refused before looking anything up
    assert "(CA_TRUSTED_NODE_ACCOUNTS: none)" in authorize(app, APP, idx, frozenset(), TD).reason  # type: ignore[union-attr]


def test_impersonation_needs_a_pod_bound_token() -> None:
    unbound = Caller(namespace="istio-system", service_account="ztunnel", node="node-1")
    assert refusal(unbound, APP) == "caller istio-system/ztunnel holds a token that is not bound to a pod"


def test_the_callers_node_is_its_pods_not_the_tokens_claim() -> None:
    # istiod's node authorizer reads spec.nodeName of the token's pod; a node claim (ours, or
    # Kubernetes 1.30's) does not move the caller to another node.
    claims_node_2 = Caller(
        namespace="istio-system",
        service_account="ztunnel",
        pod_name="ztunnel-a",
        pod_uid="uid-a",
        node="node-2",
    )
    assert decide(claims_node_2, APP) == APP
    assert refusal(claims_node_2, ELSEWHERE) == f"no workload running as {ELSEWHERE} on node 'node-1'"
    no_claim = Caller(
        namespace="istio-system", service_account="ztunnel", pod_name="ztunnel-a", pod_uid="uid-a"
    )
    assert decide(no_claim, APP) == APP


def test_impersonation_from_a_pod_that_no_longer_exists_is_refused() -> None:
    stale = Caller(
        namespace="istio-system",
        service_account="ztunnel",
        pod_name="ztunnel-a",
        pod_uid="uid-old",
        node="node-1",
    )
    assert (
        refusal(stale, APP)
        == "pod istio-system/ztunnel-a found, but its UID uid-a is not the token's uid-old"
    )
    gone = Caller(namespace="istio-system", service_account="ztunnel", pod_name="ztunnel-b", pod_uid="uid-b")
    assert refusal(gone, APP) == "failed to look up the caller's pod istio-system/ztunnel-b: not found"


def test_impersonation_from_a_pod_of_another_account_or_unscheduled_is_refused() -> None:
    idx = index()
    idx.pods[("istio-system", "ztunnel-a")] = BoundPod(
        uid="uid-a", service_account="other", node_name="node-1"
    )
    assert refusal(ZTUNNEL, APP, idx) == "pod istio-system/ztunnel-a runs as other, not the token's ztunnel"
    idx.pods[("istio-system", "ztunnel-a")] = BoundPod(uid="uid-a", service_account="ztunnel", node_name="")
    assert refusal(ZTUNNEL, APP, idx) == "the caller's pod istio-system/ztunnel-a is not scheduled to a node"


def test_impersonating_another_trust_domain_is_refused() -> None:
    assert refusal(ZTUNNEL, Identity("other.org", "ns1", "app")) == (
        "spiffe://other.org/ns/ns1/sa/app is not in this mesh's trust domain 'cluster.local'"
    )


# --- parsing the call ---------------------------------------------------------------------------


def test_bearer_token_is_taken_from_the_authorization_header() -> None:
    assert bearer_token([("clusterid", "x"), ("authorization", "Bearer abc.def.ghi")]) == "abc.def.ghi"
    assert bearer_token([("authorization", "Basic x"), ("authorization", "Bearer tok")]) == "tok"
    assert bearer_token([]) == Refusal(
        reason="no authorization header; send 'authorization: Bearer <service account token>'"
    )
    assert bearer_token([("authorization", "Bearer  ")]) == Refusal(
        reason="the authorization header holds an empty bearer token"
    )
    assert bearer_token([("authorization", "token")]) == Refusal(
        reason="the authorization header is not 'Bearer <token>'"
    )


@given(st.lists(st.tuples(st.sampled_from(["authorization", "clusterid", "x"]), st.text() | st.binary())))
def test_any_metadata_gives_a_token_or_a_refusal(metadata: list[tuple[str, object]]) -> None:
    result = bearer_token(metadata)
    assert isinstance(result, Refusal) or (isinstance(result, str) and result)
    assert check_cluster_id(metadata, "Kubernetes") is None or isinstance(
        check_cluster_id(metadata, "Kubernetes"), Refusal
    )


def test_cluster_id_empty_or_ours_is_accepted() -> None:
    assert check_cluster_id([], "Kubernetes") is None
    assert check_cluster_id([("clusterid", "")], "Kubernetes") is None
    assert check_cluster_id([("clusterid", "Kubernetes")], "Kubernetes") is None
    assert check_cluster_id([("clusterid", "east")], "Kubernetes") == Refusal(
        reason="unknown cluster 'east'; this control plane serves cluster 'Kubernetes'"
    )


def test_impersonated_identity_is_read_from_the_metadata() -> None:
    assert requested_identity({}) is None
    assert requested_identity({"ImpersonatedIdentity": ""}) is None
    assert requested_identity({"ImpersonatedIdentity": str(APP)}) == APP
    assert requested_identity({"ImpersonatedIdentity": 3.0}) == Refusal(
        reason="ImpersonatedIdentity is not a string", impersonation=True
    )
    garbled = requested_identity({"ImpersonatedIdentity": "spiffe://td/ns/x"})
    assert isinstance(garbled, Refusal) and garbled.reason.startswith(
        "failed to validate impersonated identity"
    )


@given(st.text())
def test_any_impersonated_identity_string_is_an_identity_or_a_refusal(text: str) -> None:
    result = requested_identity({"ImpersonatedIdentity": text})
    assert result is None or isinstance(result, Identity | Refusal)


@pytest.mark.parametrize(
    ("requested", "expected"), [(0, 86400), (-5, 86400), (10, 10), (86400 * 365, 90 * 86400)]
)
def test_lifetime_defaults_and_cap(requested: int, expected: int) -> None:
    assert certificate_ttl_s(requested, default_s=86400, max_s=90 * 86400) == expected


# --- the whole decision ----------------------------------------------------------------------------


ISSUER = TokenIssuer.generate()
SERVER = CaServer(
    CertificateAuthority.insecure_test_ca(),
    ISSUER.verifier(),
    trust_domain=TD,
    node_index=index(),
    clock=lambda: NOW,
)


def request(impersonate: Identity | None = None, ttl_s: int = 0) -> ca_pb2.IstioCertificateRequest:
    req = ca_pb2.IstioCertificateRequest(csr="unused by decide", validity_duration=ttl_s)
    if impersonate is not None:
        req.metadata.CopyFrom(
            struct_pb2.Struct(
                fields={"ImpersonatedIdentity": struct_pb2.Value(string_value=str(impersonate))}
            )
        )
    return req


def ztunnel_metadata(**extra: str) -> list[tuple[str, str]]:
    token = ISSUER.mint(
        namespace="istio-system",
        service_account="ztunnel",
        pod_name="ztunnel-a",
        pod_uid="uid-a",
        node="node-1",
        now=NOW,
    )
    return [("authorization", f"Bearer {token}"), *extra.items()]


async def test_decide_plans_an_impersonated_issuance() -> None:
    plan = await SERVER.plan(ztunnel_metadata(clusterid="Kubernetes"), request(APP, ttl_s=600), NOW)
    assert plan == Issuance(identity=APP, ttl_s=600, caller=ZTUNNEL)


async def test_decide_without_impersonation_issues_the_callers_identity_for_the_default_lifetime() -> None:
    plan = await SERVER.plan(ztunnel_metadata(), request(), NOW)
    assert isinstance(plan, Issuance)
    assert (plan.identity, plan.ttl_s) == (Identity(TD, "istio-system", "ztunnel"), 86400)


@pytest.mark.parametrize(
    ("metadata", "req", "message"),
    [
        ([], request(), "request authenticate failure: no authorization header"),
        (
            [("authorization", "Bearer x.y.z")],
            request(),
            "request authenticate failure: the token is not a JWS compact serialization",
        ),
        (
            ztunnel_metadata(clusterid="east"),
            request(),
            "request authenticate failure: unknown cluster 'east'",
        ),
        (ztunnel_metadata(), request(ELSEWHERE), "request impersonation authentication failure: no workload"),
    ],
)
async def test_decide_refuses_with_a_reason(
    metadata: list[tuple[str, str]], req: ca_pb2.IstioCertificateRequest, message: str
) -> None:
    plan = await SERVER.plan(metadata, req, NOW)
    assert isinstance(plan, Refusal)
    assert plan.message.startswith(message)


async def test_decide_refuses_an_expired_token() -> None:
    plan = await SERVER.plan(ztunnel_metadata(), request(APP), NOW + 3 * 3600)
    assert isinstance(plan, Refusal) and "expired" in plan.reason


def test_server_repr_counts() -> None:
    assert repr(SERVER) == "CaServer(trust domain 'cluster.local', cluster 'Kubernetes', 0 issued, 0 refused)"


def test_trusted_node_accounts_parse_like_istiods_env() -> None:
    assert parse_trusted_node_accounts("istio-system/ztunnel, kube-system/node-proxy,") == frozenset(
        {"istio-system/ztunnel", "kube-system/node-proxy"}
    )
    assert parse_trusted_node_accounts("") == frozenset()
    with pytest.raises(ConfigError):
        parse_trusted_node_accounts("ztunnel")
