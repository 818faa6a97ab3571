"""What the node proxy's DNS proxy does with one query: answer it, forward it, or refuse it.

Counterparts: ztunnel src/dns/server.rs (`Store`: aliases, wildcards, `find_server`,
`get_addresses`, `service_family_allowed`), src/dns/handler.rs (opcode and message-type checks)
and src/dns/name_util.rs. Behaviour follows docs/istio-behaviour.md, "DNS proxy".

Pure: a parsed query, the client workload and a read-only view of the mesh go in, a typed
decision comes out (`LocalAnswer`, `Forward` or `Refuse`). No sockets, no clock; the shuffle
of the answer takes an injected `random.Random`. dnspython is used for the message only.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rdtypes.ANY.CNAME
import dns.rdtypes.IN.A
import dns.rdtypes.IN.AAAA
import dns.rrset

from ..config import DEFAULT_CLUSTER_DOMAIN
from ..net import IPAddress
from ..state.model import IpFamilies, Service, Visibility, Workload
from ..state.store import StateReader

# Records we serve carry ztunnel's TTL: short, so that VIP changes reach clients quickly.
ANSWER_TTL_S = 30
# RFC 1035 4.2.1: a UDP reply larger than this needs EDNS (RFC 6891) or gets truncated.
MIN_UDP_PAYLOAD_BYTES = 512
DNS_HEADER_BYTES = 12

SVC_LABEL = "svc"
WILDCARD_LABEL = "*"

# Access-log `result` values (docs/istio-behaviour.md, "Logs").
RESULT_SUCCESS = "success"
RESULT_NO_RECORDS = "no records"
RESULT_FAMILY_NOT_SUPPORTED = "service does not support this record type"

Labels = tuple[str, ...]


# -- inputs -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class DnsSettings:
    """What the resolver needs from the node proxy's configuration."""

    cluster_domain: str = DEFAULT_CLUSTER_DOMAIN
    # None: shared mode, where ztunnel synthesises each pod's search list from its namespace
    # (the pod's own resolv.conf is not read, ztunnel#555). Dedicated mode passes the search
    # list of the proxy's own /etc/resolv.conf.
    search_domains: tuple[str, ...] | None = None
    prefered_service_namespace: str | None = None
    ipv6_enabled: bool = True

    def search_list(self, client_namespace: str) -> tuple[str, ...]:
        if self.search_domains is not None:
            return self.search_domains
        domain = self.cluster_domain
        return (f"{client_namespace}.svc.{domain}", f"svc.{domain}", domain)


class MeshView(Protocol):
    """The slice of the proxy state the resolver reads."""

    def services_for_host(self, hostname: str) -> Sequence[Service]:
        """Every service with exactly this hostname, in arrival order."""
        ...

    def workload(self, uid: str) -> Workload | None: ...


class StateView:
    """`MeshView` over a `StateReader`: the store's own host-name index, every candidate (DNS
    ranks them differently from routing: VIP-or-headless filter, preferred namespace)."""

    __slots__ = ("_state",)

    def __init__(self, state: StateReader) -> None:
        self._state = state

    def services_for_host(self, hostname: str) -> Sequence[Service]:
        return self._state.services.services_for_hostname(hostname)

    def workload(self, uid: str) -> Workload | None:
        return self._state.workloads.find_uid(uid)

    def __repr__(self) -> str:
        return f"<StateView v{self._state.version}: {self._state.services.hostname_count} hostnames indexed>"


@dataclass(frozen=True, slots=True, kw_only=True)
class DnsRequest:
    """A query that parsed; `message` is dnspython's view of it."""

    message: dns.message.Message

    @property
    def question(self) -> dns.rrset.RRset | None:
        return self.message.question[0] if len(self.message.question) == 1 else None

    @property
    def query_type(self) -> str:
        """Lower-case type name as the metrics label it (`a`, `aaaa`, `srv`)."""
        q = self.question
        return dns.rdatatype.to_text(q.rdtype).lower() if q is not None else "unknown"

    @property
    def name(self) -> str:
        q = self.question
        return q.name.to_text() if q is not None else ""


@dataclass(frozen=True, slots=True, kw_only=True)
class MalformedRequest:
    """Bytes that are not a DNS message. With a readable header we can still say FORMERR."""

    id: int | None
    opcode: int
    reason: str


def parse_request(wire: bytes) -> DnsRequest | MalformedRequest:
    """Parse a query off the wire; never raises."""
    header_id = int.from_bytes(wire[:2], "big") if len(wire) >= DNS_HEADER_BYTES else None
    opcode = (wire[2] >> 3) & 0xF if len(wire) >= DNS_HEADER_BYTES else 0
    try:
        message = dns.message.from_wire(wire)
    except (dns.exception.DNSException, ValueError, UnicodeError, IndexError, KeyError, TypeError) as e:
        # dnspython raises its own errors for most bad input, and plain ones for some rdata.
        return MalformedRequest(id=header_id, opcode=opcode, reason=f"{type(e).__name__}: {e}")
    return DnsRequest(message=message)


# -- decisions ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalAnswer:
    """We are the authority: reply with `response` (built, not yet serialized)."""

    response: dns.message.Message = field(compare=False)
    result: str
    service: Service = field(compare=False)
    matched_name: str  # the hostname (maybe a wildcard) the service was found under
    addresses: tuple[IPAddress, ...] = ()
    cname: str | None = None  # set when the name matched only with a search domain stripped


@dataclass(frozen=True, slots=True, kw_only=True)
class Forward:
    """Not ours to answer: send it to the upstream nameservers."""

    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Refuse:
    """Reply with an error code and no records."""

    rcode: dns.rcode.Rcode
    reason: str
    # ztunnel counts requests from an unknown client in istio_dns_requests_total, but not
    # messages its handler turns away (wrong opcode, a response).
    counted: bool = False


Decision = LocalAnswer | Forward | Refuse


@dataclass(frozen=True, slots=True, kw_only=True)
class Alias:
    """One name to look the query up under, and what it was before a search domain came off."""

    name: Labels
    stripped: Labels | None = None


def decide(
    request: DnsRequest,
    client: Workload | None,
    view: MeshView,
    settings: DnsSettings,
    rng: random.Random,
) -> Decision:
    message = request.message
    if message.flags & dns.flags.QR:
        return Refuse(rcode=dns.rcode.FORMERR, reason="received a response, not a query")
    if message.opcode() != dns.opcode.QUERY:
        return Refuse(rcode=dns.rcode.NOTIMP, reason=f"opcode {dns.opcode.to_text(message.opcode())}")
    question = request.question
    if question is None:
        return Refuse(rcode=dns.rcode.FORMERR, reason=f"{len(message.question)} questions, expected 1")
    if client is None:
        return Refuse(rcode=dns.rcode.SERVFAIL, reason="unknown source workload", counted=True)
    if question.rdtype not in (dns.rdatatype.A, dns.rdatatype.AAAA) or question.rdclass != dns.rdataclass.IN:
        return Forward(reason="record type not served locally")
    labels = name_labels(question.name)
    if labels is None:
        return Forward(reason="name is not a hostname")
    found = find_service(labels, client, view, settings)
    if found is None:
        return Forward(reason="unknown host")
    service, matched, alias = found
    return _answer(request, question, client, service, matched, alias, view, settings, rng)


def _answer(
    request: DnsRequest,
    question: dns.rrset.RRset,
    client: Workload,
    service: Service,
    matched: Labels,
    alias: Alias,
    view: MeshView,
    settings: DnsSettings,
    rng: random.Random,
) -> LocalAnswer:
    response = dns.message.make_response(
        request.message,
        recursion_available=True,
        our_payload=max(request.message.payload, MIN_UDP_PAYLOAD_BYTES),
    )
    response.flags |= dns.flags.AA
    version = 4 if question.rdtype == dns.rdatatype.A else 6
    matched_name = ".".join(matched)
    # Found the host, so never NXDOMAIN: an empty NOERROR says "no records of this type".
    if not family_allowed(service, version, settings.ipv6_enabled):
        return LocalAnswer(
            result=RESULT_FAMILY_NOT_SUPPORTED, response=response, service=service, matched_name=matched_name
        )
    addresses = service_addresses(service, client, version, view)
    rng.shuffle(addresses)  # DNS-level load balancing across VIPs / endpoints
    if not addresses:
        return LocalAnswer(
            result=RESULT_NO_RECORDS, response=response, service=service, matched_name=matched_name
        )
    owner = question.name
    cname = None
    if alias.stripped is not None and matched[0] != WILDCARD_LABEL:
        # The client's resolver appended one of its search domains; tell it the real name.
        target = dns.name.from_text(".".join(alias.stripped))
        response.answer.append(
            dns.rrset.from_rdata(
                owner,
                ANSWER_TTL_S,
                # dnspython leaves the record constructors unannotated.
                dns.rdtypes.ANY.CNAME.CNAME(dns.rdataclass.IN, dns.rdatatype.CNAME, target),  # type: ignore[no-untyped-call]
            )
        )
        owner, cname = target, target.to_text()
    rdtype = dns.rdatatype.A if version == 4 else dns.rdatatype.AAAA
    rrset = dns.rrset.RRset(owner, dns.rdataclass.IN, rdtype)
    rrset.update_ttl(ANSWER_TTL_S)
    for ip in addresses:
        rdata_cls = dns.rdtypes.IN.A.A if version == 4 else dns.rdtypes.IN.AAAA.AAAA
        rrset.add(rdata_cls(dns.rdataclass.IN, rdtype, str(ip)))
    response.answer.append(rrset)
    return LocalAnswer(
        result=RESULT_SUCCESS,
        response=response,
        service=service,
        matched_name=matched_name,
        addresses=tuple(addresses),
        cname=cname,
    )


def refuse_response(
    request: DnsRequest | MalformedRequest, rcode: dns.rcode.Rcode
) -> dns.message.Message | None:
    """An error reply without records; None when the message had no header to answer."""
    if isinstance(request, MalformedRequest):
        if request.id is None:
            return None
        response = dns.message.Message(id=request.id)
        response.flags = dns.flags.QR | dns.flags.RA
        response.set_opcode(dns.opcode.Opcode(request.opcode))
        response.set_rcode(rcode)
        return response
    message = request.message
    response = dns.message.Message(id=message.id)
    response.flags = dns.flags.QR | dns.flags.RA | (message.flags & dns.flags.RD)
    response.set_opcode(message.opcode())
    response.set_rcode(rcode)
    if message.opcode() == dns.opcode.QUERY:
        response.question = list(message.question)
    return response


def forwarded_response(request: DnsRequest, upstream: dns.message.Message) -> dns.message.Message:
    """The client's reply built from an upstream answer: its code and records, not authoritative."""
    response = dns.message.make_response(
        request.message,
        recursion_available=True,
        our_payload=max(request.message.payload, MIN_UDP_PAYLOAD_BYTES),
    )
    response.flags &= ~dns.flags.AA
    response.set_rcode(upstream.rcode())
    response.answer = list(upstream.answer)
    response.authority = list(upstream.authority)
    response.additional = list(upstream.additional)
    return response


def encode_response(response: dns.message.Message, *, max_bytes: int) -> bytes:
    """Serialize; a reply that does not fit `max_bytes` is truncated with TC set (RFC 2181 9)."""
    return response.to_wire(max_size=max_bytes, prefer_truncation=True)


def udp_limit(request: DnsRequest | MalformedRequest) -> int:
    """How large a UDP reply this client accepts: its EDNS payload size, at least 512."""
    if isinstance(request, DnsRequest) and request.message.edns >= 0:
        return max(request.message.payload, MIN_UDP_PAYLOAD_BYTES)
    return MIN_UDP_PAYLOAD_BYTES


# -- name matching ------------------------------------------------------------------------------


def name_labels(name: dns.name.Name) -> Labels | None:
    """Lower-case text labels without the root; None if a label cannot be part of a hostname."""
    out = []
    for raw in name.labels:
        if not raw:
            continue
        if b"." in raw or not raw.isascii():
            return None
        out.append(raw.decode("ascii").lower())
    return tuple(out)


def _split(domain: str) -> Labels:
    return tuple(label for label in domain.lower().strip(".").split(".") if label)


def kube_fqdns(name: Labels, client_namespace: str, cluster_domain: str) -> list[Labels]:
    """The Kubernetes FQDNs a short name can stand for, seen from a pod in `client_namespace`.

    Only the forms the number of labels allows: `svc`, `svc.ns`, `svc.ns.svc`, and the pod
    forms `pod.subdomain[.ns[.svc]]` of StatefulSet members.
    """
    domain = _split(cluster_domain)
    svc_domain = (SVC_LABEL, *domain)
    namespaced = (client_namespace, *svc_domain)
    ends_in_svc = len(name) > 1 and name[-1] == SVC_LABEL
    match len(name):
        case 1:
            return [name + namespaced]
        case 2:
            return [name + svc_domain, name + namespaced]
        case 3:
            out = [name + domain] if ends_in_svc else []
            out.append(name + svc_domain)
            return out
        case 4 if ends_in_svc:
            return [name + domain]
    return []


def trim_domain(name: Labels, domain: Labels) -> Labels | None:
    """`name` without the trailing `domain`; None unless something is left."""
    if not domain or len(name) <= len(domain) or name[-len(domain) :] != domain:
        return None
    return name[: -len(domain)]


def aliases(name: Labels, client_namespace: str, settings: DnsSettings) -> list[Alias]:
    """Every name the query may mean, most specific first, without repeats."""
    out: dict[Labels, Alias] = {}

    def add(alias: Alias) -> None:
        out.setdefault(alias.name, alias)

    add(Alias(name=name))
    for fqdn in kube_fqdns(name, client_namespace, settings.cluster_domain):
        add(Alias(name=fqdn))
    for search in settings.search_list(client_namespace):
        stripped = trim_domain(name, _split(search))
        if stripped is None:
            continue
        add(Alias(name=stripped, stripped=stripped))
        for fqdn in kube_fqdns(stripped, client_namespace, settings.cluster_domain):
            add(Alias(name=fqdn, stripped=stripped))
    return list(out.values())


def wildcards(name: Labels) -> list[Labels]:
    """`www.example.com` -> itself, `*.example.com`, `*.com`."""
    out = [name]
    rest = name
    while len(rest) > 1:
        out.append((WILDCARD_LABEL, *rest[1:]))
        rest = rest[1:]
    return out


def is_kubernetes_headless(service: Service, cluster_domain: str) -> bool:
    return not service.vips and service.hostname.lower().endswith(f".svc.{cluster_domain.lower()}")


def _visible(service: Service, client_namespace: str) -> bool:
    return service.visibility is not Visibility.NAMESPACE or service.namespace == client_namespace


def best_service(services: Sequence[Service], client_namespace: str, preferred: str | None) -> Service | None:
    """The client's own namespace, then a canonical service, then the preferred namespace, then the first to
    arrive (docs/istio-behaviour.md, "Workloads and services")."""
    best: Service | None = None
    best_rank: tuple[bool, bool, bool] | None = None
    for service in services:
        rank = (
            service.namespace == client_namespace,
            service.canonical,
            preferred is not None and service.namespace == preferred,
        )
        if best_rank is None or rank > best_rank:
            best, best_rank = service, rank
    return best


def find_service(
    name: Labels, client: Workload, view: MeshView, settings: DnsSettings
) -> tuple[Service, Labels, Alias] | None:
    """The service the client means, the hostname it was found under and the alias that led there."""
    for alias in aliases(name, client.namespace, settings):
        for candidate in wildcards(alias.name):
            services = [
                s
                for s in view.services_for_host(".".join(candidate))
                # No VIP and not a Kubernetes headless service: let the upstream resolve it.
                if (s.vips or is_kubernetes_headless(s, settings.cluster_domain))
                and _visible(s, client.namespace)
            ]
            service = best_service(services, client.namespace, settings.prefered_service_namespace)
            if service is not None:
                return service, candidate, alias
    return None


def family_allowed(service: Service, version: int, ipv6_enabled: bool) -> bool:
    """Whether the service answers this family at all: headless pods may be dual-stack even when
    their service is single-stack, and a disabled IPv6 means no AAAA anywhere."""
    if version == 6 and not ipv6_enabled:
        return False
    if service.ip_families is IpFamilies.IPV4_ONLY and version == 6:
        return False
    return not (service.ip_families is IpFamilies.IPV6_ONLY and version == 4)


def service_addresses(service: Service, client: Workload, version: int, view: MeshView) -> list[IPAddress]:
    if not service.vips:
        # Headless: one address per endpoint workload, the first of the asked family.
        out = []
        for endpoint in service.endpoints.values():
            workload = view.workload(endpoint.workload_uid)
            if workload is None:
                continue
            ip = next((ip for ip in workload.workload_ips if ip.version == version), None)
            if ip is not None:
                out.append(ip)
        return out
    # A VIP on another network is not reachable from the client directly.
    return [
        vip.address
        for vip in service.vips
        if vip.network == client.network and vip.address.version == version
    ]


__all__ = [
    "ANSWER_TTL_S",
    "Alias",
    "Decision",
    "DnsRequest",
    "DnsSettings",
    "Forward",
    "LocalAnswer",
    "MalformedRequest",
    "MeshView",
    "Refuse",
    "StateView",
    "aliases",
    "decide",
    "encode_response",
    "forwarded_response",
    "kube_fqdns",
    "parse_request",
    "refuse_response",
    "udp_limit",
    "wildcards",
]
