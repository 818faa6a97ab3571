"""One error hierarchy for the whole project.

Expected failures (denied, no healthy endpoint, connect refused) are values, not exceptions;
these classes are for broken input and broken invariants. Each error can carry an operator
hint saying what to check.
"""

from __future__ import annotations


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
