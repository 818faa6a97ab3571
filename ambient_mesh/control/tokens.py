"""Service-account JWTs that the control plane signs and checks itself.

Counterparts: the Kubernetes projected service-account token (its claims), and istiod's
authenticate/kubeauth, which has the API server review such a token. Without an API server we
are the issuer: `TokenIssuer` mints ES256 tokens carrying the same claims a kubelet-mounted
`istio-token` carries, and `TokenVerifier` checks one the way a TokenReview would (signature,
issuer, audience, validity window) and returns who the caller is.

Signing and checking go through PyJWT with an algorithm allow-list of ES256 alone, so the `alg`
confusion attacks (`none`, HS256 keyed with the public key) have nothing to work with; PyJWT
checks the signature, the issuer and the audience. The validity window is checked here against
the `now` the caller passes (PyJWT reads the wall clock), with the skew Kubernetes allows.
Pure: the caller passes `now`.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.utils import base64url_encode

from ..errors import AmbientError, ConfigError
from ..host.private import private_dir
from ..identity.spiffe import Identity

ALGORITHM = "ES256"
DEFAULT_ISSUER = "ambient-mesh"
# istiod's TOKEN_AUDIENCES default, and the audience of the token ztunnel's pod mounts.
DEFAULT_AUDIENCE = "istio-ca"
DEFAULT_TOKEN_TTL_S = 3600
# Clocks on different nodes disagree a little; go-jose (under Kubernetes' token checks) allows
# a minute either way.
CLOCK_SKEW_S = 60
# A Kubernetes token is about 1 KiB; anything far larger is not one, and is not worth parsing.
MAX_TOKEN_CHARS = 16 * 1024
# Far beyond any real date, and small enough that float() of it cannot overflow.
MAX_NUMERIC_DATE = 2**53
SUBJECT_PREFIX = "system:serviceaccount:"
KUBERNETES_CLAIM = "kubernetes.io"

# RFC 1123 labels joined by dots: what Kubernetes allows for namespace, service account,
# pod and node names. Anything else could not come from a real token and would not fit in
# a SPIFFE id either.
_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?\Z")


class AuthenticationError(AmbientError):
    """A bearer token that does not prove who the caller is; `reason` says why."""

    def __init__(self, reason: str, *, hint: str | None = None) -> None:
        super().__init__(reason, hint=hint)
        self.reason = reason


@dataclass(frozen=True, slots=True, kw_only=True)
class Caller:
    """Who a verified token speaks for (istiod: `security.KubernetesInfo`)."""

    namespace: str
    service_account: str
    pod_name: str | None = None
    pod_uid: str | None = None
    node: str | None = None

    def identity(self, trust_domain: str) -> Identity:
        return Identity(trust_domain, self.namespace, self.service_account)

    @property
    def account(self) -> str:
        """`namespace/serviceaccount`, the form CA_TRUSTED_NODE_ACCOUNTS lists."""
        return f"{self.namespace}/{self.service_account}"

    def __str__(self) -> str:
        bound = f", pod {self.namespace}/{self.pod_name}" if self.pod_name else ""
        node = f", node {self.node}" if self.node else ""
        return f"{self.account}{bound}{node}"


def key_id(public_key: ec.EllipticCurvePublicKey) -> str:
    """`kid`: a digest of the public key, so a token names the key that signed it."""
    spki = public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return base64url_encode(hashlib.sha256(spki).digest()[:16]).decode("ascii")


class TokenIssuer:
    """Mints tokens shaped like Kubernetes projected service-account tokens."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, issuer: str = DEFAULT_ISSUER) -> None:
        if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
            raise ConfigError("token signing key", "ES256 needs an ECDSA P-256 private key")
        self._key = key
        self.issuer = issuer
        self.kid = key_id(key.public_key())

    def __repr__(self) -> str:
        return f"TokenIssuer(issuer={self.issuer!r}, kid={self.kid!r})"

    @classmethod
    def generate(cls, issuer: str = DEFAULT_ISSUER) -> TokenIssuer:
        return cls(ec.generate_private_key(ec.SECP256R1()), issuer)

    @classmethod
    def from_pem(cls, pem: bytes, issuer: str = DEFAULT_ISSUER) -> TokenIssuer:
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as e:
            raise ConfigError("token signing key", f"not an unencrypted PEM private key: {e}") from e
        return cls(key, issuer)  # type: ignore[arg-type]

    @property
    def public_key(self) -> ec.EllipticCurvePublicKey:
        return self._key.public_key()

    def private_key_pem(self) -> bytes:
        return self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def verifier(self, audiences: frozenset[str] | set[str] = frozenset({DEFAULT_AUDIENCE})) -> TokenVerifier:
        return TokenVerifier(self.public_key, self.issuer, frozenset(audiences))

    def mint(
        self,
        *,
        namespace: str,
        service_account: str,
        pod_name: str | None = None,
        pod_uid: str | None = None,
        node: str | None = None,
        audience: str = DEFAULT_AUDIENCE,
        ttl_s: int = DEFAULT_TOKEN_TTL_S,
        now: float,
    ) -> str:
        for what, value in (
            ("namespace", namespace),
            ("service account", service_account),
            ("pod name", pod_name),
            ("node", node),
        ):
            if value is not None and not _K8S_NAME.match(value):
                raise ConfigError(what, f"{value!r} is not a Kubernetes name (lower-case RFC 1123)")
        if (pod_name is None) != (pod_uid is None):
            raise ConfigError("pod", "a pod-bound token needs both the pod name and its UID")
        if ttl_s <= 0:
            raise ConfigError("token ttl", f"{ttl_s} s is not a lifetime; use a positive number of seconds")
        k8s: dict[str, Any] = {"namespace": namespace, "serviceaccount": {"name": service_account}}
        if pod_name is not None:
            k8s["pod"] = {"name": pod_name, "uid": pod_uid}
        if node is not None:
            k8s["node"] = {"name": node}
        issued = int(now)
        claims = {
            "iss": self.issuer,
            "aud": [audience],
            "sub": f"{SUBJECT_PREFIX}{namespace}:{service_account}",
            "iat": issued,
            "nbf": issued,
            "exp": issued + ttl_s,
            KUBERNETES_CLAIM: k8s,
        }
        return jwt.encode(claims, self._key, algorithm=ALGORITHM, headers={"typ": "JWT", "kid": self.kid})


class TokenVerifier:
    """Checks tokens from one issuer and key; what a TokenReview does for istiod."""

    def __init__(
        self,
        public_key: ec.EllipticCurvePublicKey,
        issuer: str = DEFAULT_ISSUER,
        audiences: frozenset[str] = frozenset({DEFAULT_AUDIENCE}),
    ) -> None:
        if not isinstance(public_key, ec.EllipticCurvePublicKey) or not isinstance(
            public_key.curve, ec.SECP256R1
        ):
            raise ConfigError("token verification key", "ES256 needs an ECDSA P-256 public key")
        self._key = public_key
        self.issuer = issuer
        self.audiences = frozenset(audiences)
        self.kid = key_id(public_key)

    def __repr__(self) -> str:
        return f"TokenVerifier(issuer={self.issuer!r}, audiences={sorted(self.audiences)}, kid={self.kid!r})"

    async def authenticate(self, token: str, now: float) -> Caller:
        """tokenreview.Authenticator: the self-minted tokens of `--dir` (the lab)."""
        return self.verify(token, now)

    def verify(self, token: str, now: float) -> Caller:
        """The caller a token speaks for, or AuthenticationError saying what is wrong with it."""
        if not isinstance(token, str) or not token:
            raise AuthenticationError("the token is empty")
        if len(token) > MAX_TOKEN_CHARS:
            raise AuthenticationError(f"the token is longer than {MAX_TOKEN_CHARS} characters")
        try:
            header = jwt.get_unverified_header(token)
        except (jwt.DecodeError, RecursionError) as e:
            raise AuthenticationError(f"the token is not a JWS compact serialization ({_why(e)})") from None
        except jwt.InvalidTokenError as e:
            # A `crit` extension PyJWT does not implement: RFC 7515 section 4.1.11 makes the
            # token invalid.
            raise AuthenticationError(f"the token's header is refused ({_why(e)})") from None
        alg = header.get("alg")
        if alg != ALGORITHM:
            raise AuthenticationError(f"the token is signed with alg {alg!r}; only {ALGORITHM} is accepted")
        kid = header.get("kid")
        if kid is not None and kid != self.kid:
            raise AuthenticationError(f"the token was signed by another key (kid {kid!r}, ours {self.kid!r})")
        try:
            claims = jwt.decode(
                token,
                self._key,
                algorithms=[ALGORITHM],
                issuer=self.issuer,
                audience=sorted(self.audiences),
                # The validity window is checked in _claims against the caller's `now`.
                options={"verify_exp": False, "verify_nbf": False, "verify_iat": False, "require": ["aud"]},
            )
        except jwt.InvalidSignatureError:
            raise AuthenticationError("the token's signature does not verify") from None
        except jwt.InvalidIssuerError:
            # Raised only once the signature verified: the claims are the signer's.
            iss = _signed_claims(token).get("iss")
            raise AuthenticationError(f"the token's issuer {iss!r} is not {self.issuer!r}") from None
        except jwt.InvalidAudienceError:
            aud = _signed_claims(token).get("aud")
            audiences = [aud] if isinstance(aud, str) else aud
            if not isinstance(audiences, list) or not all(isinstance(a, str) for a in audiences):
                raise AuthenticationError(
                    "the token's aud claim is not a string or a list of strings"
                ) from None
            raise AuthenticationError(
                f"the token's audiences {audiences} do not include {sorted(self.audiences)}"
            ) from None
        except jwt.MissingRequiredClaimError as e:
            raise AuthenticationError(f"the token has no {e.claim} claim") from None
        except (jwt.InvalidTokenError, RecursionError) as e:
            raise AuthenticationError(f"the token is invalid ({_why(e)})") from None
        return self._claims(claims, now)

    def _claims(self, claims: Mapping[str, Any], now: float) -> Caller:
        exp = _time(claims, "exp", required=True)
        assert exp is not None
        if now >= exp + CLOCK_SKEW_S:
            raise AuthenticationError(f"the token expired at {exp:.0f} (now {now:.0f})")
        nbf = _time(claims, "nbf", required=False)
        if nbf is not None and now < nbf - CLOCK_SKEW_S:
            raise AuthenticationError(f"the token is not valid before {nbf:.0f} (now {now:.0f})")
        _time(claims, "iat", required=False)

        k8s = claims.get(KUBERNETES_CLAIM)
        if not isinstance(k8s, dict):
            raise AuthenticationError(
                f"the token has no {KUBERNETES_CLAIM} claim; it is not a service-account token"
            )
        namespace = _name(k8s.get("namespace"), "namespace")
        account = k8s.get("serviceaccount")
        service_account = _name(
            account.get("name") if isinstance(account, dict) else None, "serviceaccount.name"
        )
        subject = f"{SUBJECT_PREFIX}{namespace}:{service_account}"
        if claims.get("sub") != subject:
            raise AuthenticationError(f"the token's sub {claims.get('sub')!r} does not match {subject!r}")
        pod_name = pod_uid = node = None
        if "pod" in k8s:
            pod = k8s["pod"]
            if not isinstance(pod, dict):
                raise AuthenticationError("the token's pod claim is not an object")
            pod_name = _name(pod.get("name"), "pod.name")
            pod_uid = pod.get("uid")
            if not isinstance(pod_uid, str) or not pod_uid:
                raise AuthenticationError("the token's pod claim has no uid")
        if "node" in k8s:
            node_claim = k8s["node"]
            node = _name(node_claim.get("name") if isinstance(node_claim, dict) else None, "node.name")
        return Caller(
            namespace=namespace,
            service_account=service_account,
            pod_name=pod_name,
            pod_uid=pod_uid,
            node=node,
        )


def is_kubernetes_name(value: object) -> bool:
    """A namespace, service account, pod or node name as Kubernetes allows it (RFC 1123)."""
    return isinstance(value, str) and _K8S_NAME.match(value) is not None


def parse_account(text: str) -> tuple[str, str]:
    """`namespace/serviceaccount` (the CLI's --sa, CA_TRUSTED_NODE_ACCOUNTS entries) as a pair."""
    namespace, sep, account = text.partition("/")
    if not sep or not _K8S_NAME.match(namespace) or not _K8S_NAME.match(account):
        raise ConfigError("service account", f"{text!r} is not namespace/serviceaccount")
    return namespace, account


def load_or_create_issuer(path: str | Path, issuer: str = DEFAULT_ISSUER) -> TokenIssuer:
    """The control plane's token key from `path`, created (mode 0600) on first use.

    The control plane and `ambient control token` share it, so tokens minted by the CLI
    verify in the running CA, and survive its restarts.
    """
    path = Path(path)
    try:
        return TokenIssuer.from_pem(path.read_bytes(), issuer)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise ConfigError(str(path), f"cannot be read: {e.strerror or e}") from e
    created = TokenIssuer.generate(issuer)
    try:
        private_dir(path.parent)
        # O_EXCL: if another process created it meanwhile, use theirs rather than overwrite it.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return TokenIssuer.from_pem(path.read_bytes(), issuer)
    except OSError as e:
        raise ConfigError(str(path), f"cannot be created: {e.strerror or e}") from e
    with os.fdopen(fd, "wb") as f:
        f.write(created.private_key_pem())
    return created


def _signed_claims(token: str) -> dict[str, Any]:
    """The payload of a token whose signature PyJWT has already verified (for error messages)."""
    claims: dict[str, Any] = jwt.decode(token, options={"verify_signature": False})
    return claims


def _why(error: BaseException) -> str:
    if isinstance(error, RecursionError):
        return "nested too deeply"
    return str(error) or type(error).__name__


def _time(claims: Mapping[str, Any], name: str, *, required: bool) -> float | None:
    value = claims.get(name)
    if value is None:
        if required:
            raise AuthenticationError(f"the token has no {name} claim")
        return None
    # bool is an int in Python, and json accepts NaN and Infinity: none of them is a NumericDate.
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (isinstance(value, int) and abs(value) > MAX_NUMERIC_DATE)
        or not math.isfinite(value)
    ):
        raise AuthenticationError(f"the token's {name} claim is not a NumericDate")
    return float(value)


def _name(value: object, what: str) -> str:
    if not isinstance(value, str) or not _K8S_NAME.match(value):
        raise AuthenticationError(
            f"the token's {KUBERNETES_CLAIM} {what} is missing or not a Kubernetes name"
        )
    return value
