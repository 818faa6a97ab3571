"""Socket addresses: parsing and formatting as ztunnel writes them.

`ip:port` for IPv4, `[ip]:port` for IPv6 (the HBONE `:authority` form, RFC 3986 3.2.2).
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass
from typing import Any

from .errors import ProtocolError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_PORT = 65535


@functools.total_ordering
@dataclass(frozen=True, slots=True)
class SocketAddr:
    ip: IPAddress
    port: int

    def __lt__(self, other: object) -> bool:
        # ipaddress refuses to order IPv4 against IPv6, so the family sorts first (IPv4 first).
        if not isinstance(other, SocketAddr):
            return NotImplemented
        return (self.ip.version, int(self.ip), self.port) < (other.ip.version, int(other.ip), other.port)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= MAX_PORT:
            raise ProtocolError(f"port {self.port} out of range 0-65535")

    def __str__(self) -> str:
        # IPv6 text always has a colon and IPv4 text never: no `version` (a Python property).
        text = ip_text(self.ip)
        return f"[{text}]:{self.port}" if ":" in text else f"{text}:{self.port}"

    @property
    def family(self) -> int:
        import socket

        return socket.AF_INET6 if self.ip.version == 6 else socket.AF_INET

    def sockaddr(self) -> tuple[str, int] | tuple[str, int, int, int]:
        """The tuple the socket module wants for this address."""
        text = ip_text(self.ip)
        return (text, self.port, 0, 0) if ":" in text else (text, self.port)

    @classmethod
    def of(cls, ip: str | IPAddress, port: int) -> SocketAddr:
        return cls(ip_address(ip), port)

    @classmethod
    def from_sockaddr(cls, sa: tuple[Any, ...]) -> SocketAddr:
        """From what `getpeername()`/`getsockname()` return; IPv4-mapped IPv6 becomes IPv4."""
        return cls(ip_address(sa[0]), int(sa[1]))

    @classmethod
    def parse(cls, text: str) -> SocketAddr:
        """Parse `ip:port` or `[ipv6]:port`; raise ProtocolError on anything else."""
        host, port = split_host_port(text)
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise ProtocolError(f"{text!r}: {host!r} is not an IP address") from None
        if ip.version == 6 and not text.startswith("["):
            raise ProtocolError(f"{text!r}: an IPv6 address must be in brackets")
        if ip.version == 4 and text.startswith("["):
            raise ProtocolError(f"{text!r}: brackets are for IPv6 addresses only (RFC 3986 3.2.2)")
        if ip.version == 6 and ip.scope_id:
            raise ProtocolError(f"{text!r}: a zone id is not allowed in an authority")
        return cls(ip, port)


# Addresses parsed from text, kept (they repeat: every accepted connection's getpeername() and
# getsockname()); ipaddress parses in pure Python, several µs per call. Bounded by LRU.
IP_TEXT_CACHE_ENTRIES = 4096


def ip_address(value: str | bytes | IPAddress) -> IPAddress:
    """An IP address; IPv4-mapped IPv6 addresses (::ffff:a.b.c.d) are unmapped to IPv4."""
    if isinstance(value, (ipaddress.IPv4Address, ipaddress.IPv6Address)):
        ip = value
    elif isinstance(value, str):
        return _ip_from_text(value)
    elif isinstance(value, bytes):
        return _ip_from_packed(value)
    else:
        ip = ipaddress.ip_address(value)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


# str(ip) by the address object: ipaddress formats in pure Python, and every access log line
# and CONNECT `forwarded` header formats the same few addresses again. Keyed by id() (an
# ipaddress hash is three Python calls; the addresses come from the caches here, so they repeat
# as objects); each entry holds its address, so the id is not reused while cached.
_ip_texts: dict[int, tuple[IPAddress, str]] = {}


def ip_text(ip: IPAddress) -> str:
    """`str(ip)`, cached by the address object (see above)."""
    hit = _ip_texts.get(id(ip))
    if hit is not None and hit[0] is ip:
        return hit[1]
    text = str(ip)
    if len(_ip_texts) >= IP_TEXT_CACHE_ENTRIES:
        _ip_texts.clear()
    _ip_texts[id(ip)] = (ip, text)
    return text


@functools.lru_cache(maxsize=IP_TEXT_CACHE_ENTRIES)
def _ip_from_packed(value: bytes) -> IPAddress:
    """Addresses from SO_ORIGINAL_DST's raw bytes (every captured connection), kept as text is."""
    ip = ipaddress.ip_address(value)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@functools.lru_cache(maxsize=IP_TEXT_CACHE_ENTRIES)
def _ip_from_text(value: str) -> IPAddress:
    if "%" in value:
        value = value.split("%", 1)[0]
    ip = ipaddress.ip_address(value)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def split_host_port(text: str) -> tuple[str, int]:
    """Split `host:port` / `[v6]:port` into its parts; the port must be decimal 0-65535."""
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or not text[end + 1 : end + 2] == ":":
            raise ProtocolError(f"{text!r}: expected [ipv6]:port")
        host, port_text = text[1:end], text[end + 2 :]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise ProtocolError(f"{text!r}: expected host:port")
        if ":" in host:
            raise ProtocolError(f"{text!r}: an IPv6 address must be in brackets")
    if not port_text.isascii() or not port_text.isdigit() or len(port_text) > 5:
        raise ProtocolError(f"{text!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if port > MAX_PORT:
        raise ProtocolError(f"{text!r}: port {port} out of range 0-65535")
    return host, port
