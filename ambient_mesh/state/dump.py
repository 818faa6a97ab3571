"""JSON views of the state for /config_dump, in ztunnel's camelCase spelling.

The same spelling the local config file uses (reference/ztunnel.md 2.3), so a dump can be read
next to the YAML that produced it.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
from typing import Any

from ..identity.spiffe import Identity
from .model import GatewayAddress, NamespacedHostname, NetworkAddress


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def to_json(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (ipaddress.IPv4Address, ipaddress.IPv6Address, ipaddress.IPv4Network,
                          ipaddress.IPv6Network, Identity)):
        return str(value)
    if isinstance(value, NetworkAddress):
        return f"{value.network}/{value.address}"
    if isinstance(value, NamespacedHostname):
        return f"{value.namespace}/{value.hostname}"
    if isinstance(value, GatewayAddress):
        return {"destination": to_json(value.destination), "hboneMtlsPort": value.hbone_mtls_port}
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_json(v) for v in value]
    if dataclasses.is_dataclass(value):
        return {_camel(f.name): to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return str(value)


def dump_workloads(state) -> list[dict]:
    return [to_json(w) for w in sorted(state.workloads, key=lambda w: w.uid)]


def dump_services(state) -> list[dict]:
    return [to_json(s) for s in sorted(state.services, key=lambda s: s.hostname)]


def dump_policies(state) -> list[dict]:
    return [to_json(p) for _key, p in sorted(state.policies.items())]
