"""The node proxy's DNS proxy (ztunnel's 15053): `resolver` decides, `server` does the I/O."""

from .resolver import (
    ANSWER_TTL_S,
    Decision,
    DnsRequest,
    DnsSettings,
    Forward,
    LocalAnswer,
    MalformedRequest,
    MeshView,
    Refuse,
    StateView,
    decide,
    parse_request,
)
from .server import DNS_PORT, DnsMetrics, DnsServer, Forwarder, ResolvConf, UpstreamFailure, UpstreamForwarder

__all__ = [
    "ANSWER_TTL_S",
    "DNS_PORT",
    "Decision",
    "DnsMetrics",
    "DnsRequest",
    "DnsServer",
    "DnsSettings",
    "Forward",
    "Forwarder",
    "LocalAnswer",
    "MalformedRequest",
    "MeshView",
    "Refuse",
    "ResolvConf",
    "StateView",
    "UpstreamFailure",
    "UpstreamForwarder",
    "decide",
    "parse_request",
]
