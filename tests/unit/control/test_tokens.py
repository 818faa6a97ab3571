"""Service-account JWTs: minting, verifying, and every way a token is refused."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from hypothesis import given, settings
from hypothesis import strategies as st

from ambient_mesh.control.tokens import (
    CLOCK_SKEW_S,
    AuthenticationError,
    Caller,
    TokenIssuer,
    TokenVerifier,
    load_or_create_issuer,
    parse_account,
)
from ambient_mesh.errors import AmbientError, ConfigError
from ambient_mesh.identity import Identity

NOW = 1_900_000_000.0
KEY = ec.generate_private_key(ec.SECP256R1())
ISSUER = TokenIssuer(KEY)
VERIFIER = ISSUER.verifier()


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def node_token(**overrides: object) -> str:
    args: dict[str, object] = dict(
        namespace="istio-system",
        service_account="ztunnel",
        pod_name="ztunnel-x1",
        pod_uid="uid-1",
        node="node-1",
        now=NOW,
    )
    args.update(overrides)
    return ISSUER.mint(**args)  # type: ignore[arg-type]


def sign_raw(header: dict[str, object], claims: object, key: ec.EllipticCurvePrivateKey | None = None) -> str:
    """A token with exactly these header and claims, ES256-signed (by our key unless told)."""
    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
    key = key or KEY
    r, s = decode_dss_signature(key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
    return f"{signing_input}.{b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"


def claims_of(token: str) -> dict[str, object]:
    return json.loads(unb64(token.split(".")[1]))


def header_of(token: str) -> dict[str, object]:
    return json.loads(unb64(token.split(".")[0]))


# --- minting -----------------------------------------------------------------------------------


def test_mint_writes_kubernetes_projected_token_claims() -> None:
    token = node_token()
    assert header_of(token) == {"alg": "ES256", "typ": "JWT", "kid": ISSUER.kid}
    assert "=" not in token
    assert claims_of(token) == {
        "iss": "ambient-mesh",
        "aud": ["istio-ca"],
        "sub": "system:serviceaccount:istio-system:ztunnel",
        "iat": int(NOW),
        "nbf": int(NOW),
        "exp": int(NOW) + 3600,
        "kubernetes.io": {
            "namespace": "istio-system",
            "serviceaccount": {"name": "ztunnel"},
            "pod": {"name": "ztunnel-x1", "uid": "uid-1"},
            "node": {"name": "node-1"},
        },
    }


def test_verify_returns_the_caller() -> None:
    caller = VERIFIER.verify(node_token(), NOW + 10)
    assert caller == Caller(
        namespace="istio-system",
        service_account="ztunnel",
        pod_name="ztunnel-x1",
        pod_uid="uid-1",
        node="node-1",
    )
    assert caller.identity("example.org") == Identity("example.org", "istio-system", "ztunnel")
    assert caller.account == "istio-system/ztunnel"
    assert str(caller) == "istio-system/ztunnel, pod istio-system/ztunnel-x1, node node-1"


def test_unbound_token_has_no_pod_or_node() -> None:
    caller = VERIFIER.verify(ISSUER.mint(namespace="ns1", service_account="sa1", now=NOW), NOW)
    assert (caller.pod_name, caller.pod_uid, caller.node) == (None, None, None)
    assert (
        "pod" not in claims_of(ISSUER.mint(namespace="ns1", service_account="sa1", now=NOW))["kubernetes.io"]
    )


@pytest.mark.parametrize(
    "overrides",
    [
        {"pod_uid": None},
        {"pod_name": None},
        {"namespace": "Bad_NS"},
        {"service_account": "a/b"},
        {"node": ""},
        {"ttl_s": 0},
    ],
)
def test_mint_refuses_what_verify_would_refuse(overrides: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        node_token(**overrides)


def test_issuer_round_trips_through_pem_and_rejects_other_curves() -> None:
    again = TokenIssuer.from_pem(ISSUER.private_key_pem())
    assert again.kid == ISSUER.kid
    assert (
        VERIFIER.verify(again.mint(namespace="ns1", service_account="sa1", now=NOW), NOW).service_account
        == "sa1"
    )
    with pytest.raises(ConfigError):
        TokenIssuer(ec.generate_private_key(ec.SECP384R1()))
    with pytest.raises(ConfigError):
        TokenIssuer.from_pem(b"not a key")
    assert repr(ISSUER) == f"TokenIssuer(issuer='ambient-mesh', kid={ISSUER.kid!r})"


# --- refusals ------------------------------------------------------------------------------------


def refused(token: str, now: float = NOW, verifier: TokenVerifier = VERIFIER) -> str:
    with pytest.raises(AuthenticationError) as info:
        verifier.verify(token, now)
    assert isinstance(info.value, AmbientError)
    return info.value.reason


def test_expired_and_not_yet_valid_tokens_are_refused_outside_the_skew() -> None:
    token = node_token(ttl_s=100)
    assert VERIFIER.verify(token, NOW + 100 + CLOCK_SKEW_S - 1).namespace == "istio-system"
    assert "expired" in refused(token, NOW + 100 + CLOCK_SKEW_S)
    assert VERIFIER.verify(token, NOW - CLOCK_SKEW_S).namespace == "istio-system"
    assert "not valid before" in refused(token, NOW - CLOCK_SKEW_S - 1)


def test_wrong_audience_and_wrong_issuer_are_refused() -> None:
    assert "audiences ['other']" in refused(node_token(audience="other"))
    other_issuer = TokenVerifier(ISSUER.public_key, "someone-else")
    assert "issuer 'ambient-mesh'" in refused(node_token(), verifier=other_issuer)
    # Several accepted audiences: one match is enough.
    two = TokenVerifier(ISSUER.public_key, "ambient-mesh", frozenset({"istio-ca", "other"}))
    assert two.verify(node_token(audience="other"), NOW).node == "node-1"


def test_token_from_another_key_is_refused() -> None:
    stranger_key = ec.generate_private_key(ec.SECP256R1())
    stranger = TokenIssuer(stranger_key)
    token = stranger.mint(namespace="istio-system", service_account="ztunnel", now=NOW)
    assert "another key" in refused(token)
    # Without a kid, the signature check is what catches it.
    header = {"alg": "ES256"}
    assert "signature does not verify" in refused(sign_raw(header, claims_of(token), stranger_key))


def test_tampered_payload_is_refused() -> None:
    head, _, sig = node_token().split(".")
    claims = claims_of(node_token())
    claims["kubernetes.io"]["serviceaccount"]["name"] = "admin"  # type: ignore[index]
    assert "signature does not verify" in refused(f"{head}.{b64(json.dumps(claims).encode())}.{sig}")


def test_alg_none_and_hs256_with_the_public_key_are_refused() -> None:
    claims = claims_of(node_token())
    none = f"{b64(json.dumps({'alg': 'none'}).encode())}.{b64(json.dumps(claims).encode())}."
    assert "alg 'none'" in refused(none)
    # The classic confusion: HMAC keyed with the verifier's public key.
    public_pem = ISSUER.public_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    signing_input = f"{b64(json.dumps({'alg': 'HS256'}).encode())}.{b64(json.dumps(claims).encode())}"
    mac = hmac.new(public_pem, signing_input.encode(), hashlib.sha256).digest()
    assert "alg 'HS256'" in refused(f"{signing_input}.{b64(mac)}")
    assert "alg None" in refused(sign_raw({"typ": "JWT"}, claims))


@pytest.mark.parametrize(
    ("token", "reason"),
    [
        ("", "empty"),
        ("abc", "Not enough segments"),
        ("a.b.c.d", "not a JWS compact serialization (Invalid header padding)"),
        ("a+b.cc.dd", "not a JWS compact serialization (Invalid header padding)"),
        ("abcde.cc.dd", "not a JWS compact serialization (Invalid header padding)"),
        (f"{b64(b'[1]')}.cc.dd", "Invalid header string: must be a json object"),
        (f"{b64(b'{')}.cc.dd", "not a JWS compact serialization (Invalid header string"),
        (f"{b64(b'[' * 100_00)}.cc.dd", "not a JWS compact serialization ("),
        ("x" * 20000, "longer than"),
    ],
)
def test_garbled_tokens_say_what_is_wrong(token: str, reason: str) -> None:
    assert reason in refused(token)


def test_short_signature_is_refused() -> None:
    head, body, sig = node_token().split(".")
    assert "signature does not verify" in refused(f"{head}.{body}.{b64(unb64(sig)[:63])}")


def test_critical_header_extensions_are_refused() -> None:
    assert "Unsupported critical extension" in refused(
        sign_raw({"alg": "ES256", "crit": ["exp"]}, claims_of(node_token()))
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda c: c.pop("exp"), "no exp claim"),
        (lambda c: c.update(exp=True), "exp claim is not a NumericDate"),
        (lambda c: c.update(exp="soon"), "exp claim is not a NumericDate"),
        (lambda c: c.update(exp=10**30), "exp claim is not a NumericDate"),
        (lambda c: c.update(nbf=[1]), "nbf claim is not a NumericDate"),
        (lambda c: c.update(aud=7), "aud claim"),
        (lambda c: c.update(aud="istio-ca") and None, None),
        (lambda c: c.pop("kubernetes.io"), "no kubernetes.io claim"),
        (lambda c: c["kubernetes.io"].pop("namespace"), "namespace is missing"),
        (lambda c: c["kubernetes.io"].update(serviceaccount="sa"), "serviceaccount.name"),
        (lambda c: c.update(sub="system:serviceaccount:istio-system:other"), "does not match"),
        (lambda c: c["kubernetes.io"].update(pod="p"), "pod claim is not an object"),
        (lambda c: c["kubernetes.io"]["pod"].pop("uid"), "pod claim has no uid"),
        (lambda c: c["kubernetes.io"].update(node={"uid": "x"}), "node.name"),
    ],
)
def test_bad_claims_are_refused(change, reason: str | None) -> None:  # noqa: ANN001
    claims = claims_of(node_token())
    change(claims)
    token = sign_raw({"alg": "ES256", "kid": ISSUER.kid}, claims)
    if reason is None:
        assert VERIFIER.verify(token, NOW).service_account == "ztunnel"
    else:
        assert reason in refused(token)


def test_non_finite_numbers_are_refused() -> None:
    claims = json.dumps(claims_of(node_token())).replace(f'"exp": {int(NOW) + 3600}', '"exp": Infinity')
    assert "Infinity" in claims
    signing_input = f"{b64(json.dumps({'alg': 'ES256'}).encode())}.{b64(claims.encode())}"
    r, s = decode_dss_signature(KEY.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
    token = f"{signing_input}.{b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"
    assert "NumericDate" in refused(token)


# --- hypothesis: a parser returns a Caller or raises AuthenticationError -----------------------


def verify_or_refuse(token: str) -> None:
    try:
        result = VERIFIER.verify(token, NOW)
    except AuthenticationError:
        return
    assert isinstance(result, Caller)


@given(st.text())
def test_any_string_is_a_caller_or_an_authentication_error(token: str) -> None:
    verify_or_refuse(token)


_b64_part = st.binary(max_size=200).map(b64) | st.text(alphabet="ABCxyz019-_=+/.", max_size=40)


@given(_b64_part, _b64_part, _b64_part)
def test_any_three_parts_are_a_caller_or_an_authentication_error(a: str, b: str, c: str) -> None:
    verify_or_refuse(f"{a}.{b}.{c}")


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=12,
)
_claim_values = st.fixed_dictionaries(
    {},
    optional={
        "iss": st.just("ambient-mesh") | _json,
        "aud": st.just(["istio-ca"]) | st.just("istio-ca") | _json,
        "exp": st.just(NOW + 10) | _json,
        "nbf": st.just(NOW - 10) | _json,
        "sub": st.just("system:serviceaccount:ns1:sa1") | _json,
        "kubernetes.io": st.fixed_dictionaries(
            {},
            optional={
                "namespace": st.just("ns1") | _json,
                "serviceaccount": st.just({"name": "sa1"}) | _json,
                "pod": st.just({"name": "p", "uid": "u"}) | _json,
                "node": st.just({"name": "n"}) | _json,
            },
        )
        | _json,
    },
)


@settings(max_examples=200)
@given(_claim_values)
def test_any_signed_claims_are_a_caller_or_an_authentication_error(claims: dict[str, object]) -> None:
    verify_or_refuse(sign_raw({"alg": "ES256"}, claims))


# --- key file and account parsing (what `ambient control token` uses) --------------------------


def test_load_or_create_issuer_creates_once_then_reuses(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "state" / "token-key.pem"
    first = load_or_create_issuer(path)
    assert path.stat().st_mode & 0o777 == 0o600
    again = load_or_create_issuer(path)
    assert again.kid == first.kid
    token = first.mint(namespace="ns1", service_account="sa1", now=NOW)
    assert again.verifier().verify(token, NOW).service_account == "sa1"
    path.write_bytes(b"garbage")
    with pytest.raises(ConfigError):
        load_or_create_issuer(path)


def test_parse_account() -> None:
    assert parse_account("istio-system/ztunnel") == ("istio-system", "ztunnel")
    for bad in ("ztunnel", "a/b/c", "/x", "NS/x"):
        with pytest.raises(ConfigError):
            parse_account(bad)
