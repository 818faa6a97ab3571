"""One error hierarchy for the whole project.

Expected failures (denied, no healthy endpoint, connect refused) are values, not exceptions;
these classes are for broken input and broken invariants. Each error can carry an operator
hint saying what to check.
"""

from __future__ import annotations

import enum


class ResponseFlag(enum.StrEnum):
    """The `response_flags` label of Istio's TCP metrics: why a proxied connection failed.

    The values ztunnel reports (src/proxy/metrics.rs `ResponseFlags`); NONE ("-") is a
    connection that ended normally. A StrEnum, so the value is the label text itself.
    """

    NONE = "-"
    DENY = "DENY"
    CONNECT = "CONNECT"
    TLS_FAILURE = "TLS_FAILURE"
    H2_HANDSHAKE_FAILURE = "H2_HANDSHAKE_FAILURE"
    NETWORK_POLICY = "NETWORK_POLICY"
    IDENTITY_ERROR = "IDENTITY_ERROR"
    CERT_REVOKED = "CERT_REVOKED"


class AmbientError(Exception):
    """Root of every error raised by ambient-mesh."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message} (hint: {self.hint})"
        return self.message


class ConfigError(AmbientError):
    """Bad configuration: an environment variable, a flag or a config file.

    `source` names what was wrong: the environment variable, or `file:line:column`.
    """

    def __init__(self, source: str, message: str, *, hint: str | None = None) -> None:
        super().__init__(f"{source}: {message}", hint=hint)
        self.source = source


class ProtocolError(AmbientError):
    """Bytes from a peer that break the protocol (SOCKS5, HBONE authority, ZDS, ...)."""


class ProxyError(AmbientError):
    """A proxied connection that could not be opened or was closed; `response_flag` is what the
    metrics and access log record for it, `status` the HTTP status an HBONE CONNECT answer had."""

    response_flag: ResponseFlag = ResponseFlag.CONNECT

    def __init__(
        self,
        message: str,
        *,
        response_flag: ResponseFlag | None = None,
        status: int | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        if response_flag is not None:
            self.response_flag = response_flag
        self.status = status


class IdentityError(AmbientError):
    """A SPIFFE id, certificate or key that cannot be used."""


class CertificateError(IdentityError):
    """A certificate chain that does not verify or does not name the expected identity."""


class BindError(AmbientError):
    """A listener could not bind its address."""

    def __init__(self, name: str, address: str, cause: OSError) -> None:
        super().__init__(
            f"{name} listener could not bind {address}: {cause.strerror or cause}",
            hint="is another proxy (or an earlier run) still listening on that port?",
        )
        self.address = address
        self.cause = cause
