"""The DNS proxy's decisions, without sockets: a table of queries as ztunnel's dns tests have."""

from __future__ import annotations

import ipaddress
import random

import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdatatype
import dns.rrset
import dns.update
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.dns.resolver import (
    ANSWER_TTL_S,
    RESULT_FAMILY_NOT_SUPPORTED,
    RESULT_NO_RECORDS,
    RESULT_SUCCESS,
    Alias,
    DnsRequest,
    DnsSettings,
    Forward,
    LocalAnswer,
    MalformedRequest,
    Refuse,
    StateView,
    aliases,
    decide,
    encode_response,
    forwarded_response,
    kube_fqdns,
    parse_request,
    refuse_response,
    udp_limit,
    wildcards,
)
from ambient_mesh.net import ip_address
from ambient_mesh.state.model import IpFamilies, NetworkAddress, Service, Visibility, Workload
from ambient_mesh.state.store import ProxyState
from tests.helpers.state_writes import load, upsert

NS1, NS2, NS3, PREFERRED = "ns1", "ns2", "ns3", "preferred-ns"
NW1, NW2 = "nw1", "nw2"


def kube_fqdn(name: str, ns: str) -> str:
    return f"{name}.{ns}.svc.cluster.local"


def svc(
    hostname: str,
    ns: str = NS1,
    vips: tuple[tuple[str, str], ...] = (),
    *,
    name: str | None = None,
    canonical: bool = False,
    ip_families: IpFamilies = IpFamilies.AUTOMATIC,
    visibility: Visibility = Visibility.PUBLIC,
) -> Service:
    return Service(
        name=name or hostname.split(".")[0],
        namespace=ns,
        hostname=hostname,
        vips=tuple(NetworkAddress(network=nw, address=ip_address(ip)) for nw, ip in vips),
        ports={80: 80},
        canonical=canonical,
        ip_families=ip_families,
        visibility=visibility,
    )


def workload(
    name: str, ns: str, ips: tuple[str, ...], services: tuple[str, ...] = (), network: str = NW1, **kw
) -> Workload:
    return Workload(
        uid=name,
        name=name,
        namespace=ns,
        network=network,
        workload_ips=tuple(ip_address(ip) for ip in ips),
        services={key: {80: 80} for key in services},
        **kw,
    )


SERVICES = [
    svc("www.google.com", vips=((NW1, "1.1.1.1"),)),
    svc(kube_fqdn("productpage", NS1), vips=((NW1, "9.9.9.9"),)),
    svc(kube_fqdn("example", NS2), NS2, vips=((NW1, "10.10.10.10"),)),
    # The same external hostname in several namespaces.
    svc("everywhere.io", NS2, ((NW1, "10.10.10.110"),)),
    svc("preferred.io", NS2, ((NW1, "10.10.10.210"),)),
    svc("everywhere.io", PREFERRED, ((NW1, "10.10.10.111"),)),
    svc("preferred.io", PREFERRED, ((NW1, "10.10.10.211"),)),
    svc("everywhere.io", NS1, ((NW1, "10.10.10.112"),)),
    svc("canonical.svc", NS2, ((NW1, "10.10.10.140"),)),
    svc("canonical.svc", NS3, ((NW1, "10.10.10.141"),), canonical=True),
    svc("canonical.with.local", NS1, ((NW1, "10.10.10.150"),)),
    svc("canonical.with.local", NS2, ((NW1, "10.10.10.151"),), canonical=True),
    svc(
        "details.ns2.svc.cluster.remote",
        NS2,
        ((NW1, "11.11.11.11"), (NW1, "12.12.12.12"), (NW1, "13.13.13.13"), (NW1, "14.14.14.14")),
        name="details",
    ),
    # IPv4-only, IPv6-only, dual stack.
    svc("ipv4.localhost", vips=((NW1, "2.2.2.2"),)),
    svc("ipv6.localhost", vips=((NW1, "2001:db8::ff00:42:8329"),)),
    svc("dual.localhost", vips=((NW1, "2.2.2.2"), (NW1, "2001:db8::ff00:42:8329"))),
    svc(
        "v4only-family.localhost",
        vips=((NW1, "2.2.2.3"), (NW1, "2001:db8::3")),
        ip_families=IpFamilies.IPV4_ONLY,
    ),
    # Wildcards.
    svc("*.wildcard", vips=((NW1, "10.10.10.10"),)),
    svc("*.b.wildcard", vips=((NW1, "11.11.11.11"),)),
    svc("*.svc.mesh.company.net", vips=((NW1, "10.1.2.3"),)),
    # VIPs on other / several networks.
    svc(kube_fqdn("nw2-only", NS1), vips=((NW2, "20.20.20.20"),)),
    svc(kube_fqdn("both-networks", NS1), vips=((NW1, "21.21.21.21"), (NW2, "22.22.22.22"))),
    # Headless services.
    svc(kube_fqdn("headless", NS1)),
    svc("headless.example.com"),
    svc("headless-no-endpoints.example.com"),
    svc(kube_fqdn("headless-ipv6", NS1), ip_families=IpFamilies.IPV6_ONLY),
    # Visible only inside its own namespace.
    svc(kube_fqdn("private", NS2), NS2, ((NW1, "40.40.40.40"),), visibility=Visibility.NAMESPACE),
]

CLIENT = workload("client", NS1, ("10.0.0.1",), canonical_name="client-app", canonical_revision="v1")
WORKLOADS = [
    CLIENT,
    workload(
        "pod-0",
        NS1,
        ("30.30.30.30", "2001:db8::30"),
        (f"{NS1}/{kube_fqdn('headless', NS1)}",),
        hostname="headless.pod0.ns1.svc.cluster.local",
    ),
    workload(
        "headless1",
        NS1,
        ("31.31.31.31", "2001:db8::31"),
        (f"{NS1}/{kube_fqdn('headless', NS1)}",),
        hostname="headless.pod1.ns1.svc.cluster.local",
    ),
    workload("headless-external", NS1, ("32.32.32.32", "2001:db8::32"), (f"{NS1}/headless.example.com",)),
    workload(
        "headless2",
        NS1,
        ("33.33.33.33", "2001:db8::33"),
        (f"{NS1}/{kube_fqdn('headless-ipv6', NS1)}",),
        hostname="headless2.pod2.ns1.svc.cluster.local",
    ),
]

SETTINGS = DnsSettings(prefered_service_namespace=PREFERRED)


def make_state() -> ProxyState:
    state = ProxyState()
    load(state, WORKLOADS, SERVICES)
    return state


STATE = make_state()
VIEW = StateView(STATE)


def query(host: str, qtype: str = "A", **kw) -> DnsRequest:
    return DnsRequest(message=dns.message.make_query(host, qtype, **kw))


def ask(
    host: str,
    qtype: str = "A",
    *,
    client: Workload | None = CLIENT,
    settings: DnsSettings = SETTINGS,
    view=VIEW,
    rng: random.Random | None = None,
):
    return decide(query(host, qtype), client, view, settings, rng or random.Random(0))


def records(response: dns.message.Message) -> list[str]:
    """Answer records as `owner TTL TYPE value`, CNAME first, then A, then AAAA, each sorted."""
    order = {dns.rdatatype.CNAME: 0, dns.rdatatype.A: 1, dns.rdatatype.AAAA: 2}
    out = []
    for rrset in response.answer:
        for rdata in rrset:
            out.append(
                (
                    order[rrset.rdtype],
                    f"{rrset.name} {rrset.ttl} {dns.rdatatype.to_text(rrset.rdtype)} {rdata}",
                )
            )
    return [text for _, text in sorted(out)]


def a(name: str, ip: str) -> str:
    return f"{name} {ANSWER_TTL_S} A {ip}"


def aaaa(name: str, ip: str) -> str:
    return f"{name} {ANSWER_TTL_S} AAAA {ip}"


def cname(name: str, target: str) -> str:
    return f"{name} {ANSWER_TTL_S} CNAME {target}"


FORWARD = "forward"

# (case name, host, query type, expected answers or FORWARD)
LOOKUP_CASES = [
    ("unsupported record type is forwarded", "productpage.ns1.", "NS", FORWARD),
    ("SRV is forwarded even for a known service", kube_fqdn("productpage", NS1), "SRV", FORWARD),
    ("non-k8s host in the mesh", "www.google.com", "A", [a("www.google.com.", "1.1.1.1")]),
    (
        "non-k8s host with a search domain: CNAME + A",
        "www.google.com.ns1.svc.cluster.local.",
        "A",
        [cname("www.google.com.ns1.svc.cluster.local.", "www.google.com."), a("www.google.com.", "1.1.1.1")],
    ),
    ("non-k8s host not in the mesh is forwarded", "www.bing.com", "A", FORWARD),
    (
        "k8s fqdn",
        "productpage.ns1.svc.cluster.local.",
        "A",
        [a("productpage.ns1.svc.cluster.local.", "9.9.9.9")],
    ),
    ("k8s name.namespace", "productpage.ns1.", "A", [a("productpage.ns1.", "9.9.9.9")]),
    ("k8s short name in the client's namespace", "productpage.", "A", [a("productpage.", "9.9.9.9")]),
    ("k8s name.namespace.svc", "productpage.ns1.svc.", "A", [a("productpage.ns1.svc.", "9.9.9.9")]),
    (
        "k8s name.namespace with a search domain: CNAME + A",
        "productpage.ns1.ns1.svc.cluster.local.",
        "A",
        [
            cname("productpage.ns1.ns1.svc.cluster.local.", "productpage.ns1."),
            a("productpage.ns1.", "9.9.9.9"),
        ],
    ),
    (
        "AAAA of an IPv4-only service after search-domain stripping: empty",
        "productpage.ns1.ns1.svc.cluster.local.",
        "AAAA",
        [],
    ),
    ("other namespace: name.namespace", "example.ns2.", "A", [a("example.ns2.", "10.10.10.10")]),
    (
        "other namespace: fqdn",
        "example.ns2.svc.cluster.local.",
        "A",
        [a("example.ns2.svc.cluster.local.", "10.10.10.10")],
    ),
    ("other namespace: name.namespace.svc", "example.ns2.svc.", "A", [a("example.ns2.svc.", "10.10.10.10")]),
    ("other namespace: short name is forwarded", "example.", "A", FORWARD),
    (
        "remote cluster domain, fqdn",
        "details.ns2.svc.cluster.remote.",
        "A",
        [
            a("details.ns2.svc.cluster.remote.", ip)
            for ip in ("11.11.11.11", "12.12.12.12", "13.13.13.13", "14.14.14.14")
        ],
    ),
    ("remote cluster domain, name.namespace is forwarded", "details.ns2.", "A", FORWARD),
    ("A query returns A records only", "dual.localhost.", "A", [a("dual.localhost.", "2.2.2.2")]),
    (
        "AAAA query returns AAAA records only",
        "dual.localhost.",
        "AAAA",
        [aaaa("dual.localhost.", "2001:db8::ff00:42:8329")],
    ),
    ("only AAAA records exist for an A query: empty, not NXDOMAIN", "ipv6.localhost.", "A", []),
    ("only A records exist for an AAAA query: empty, not NXDOMAIN", "ipv4.localhost.", "AAAA", []),
    ("ipFamilies IPv4 hides the service's IPv6 VIP", "v4only-family.localhost.", "AAAA", []),
    (
        "ipFamilies IPv4 still answers A",
        "v4only-family.localhost.",
        "A",
        [a("v4only-family.localhost.", "2.2.2.3")],
    ),
    ("wildcard", "foo.wildcard.", "A", [a("foo.wildcard.", "10.10.10.10")]),
    ("the more specific wildcard wins", "a.b.wildcard.", "A", [a("a.b.wildcard.", "11.11.11.11")]),
    (
        "wildcard with a domain",
        "foo.svc.mesh.company.net.",
        "A",
        [a("foo.svc.mesh.company.net.", "10.1.2.3")],
    ),
    (
        "wildcard covering a namespace label",
        "foo.foons.svc.mesh.company.net.",
        "A",
        [a("foo.foons.svc.mesh.company.net.", "10.1.2.3")],
    ),
    (
        "wildcard with a search domain: no CNAME",
        "foo.svc.mesh.company.net.ns1.svc.cluster.local.",
        "A",
        [a("foo.svc.mesh.company.net.ns1.svc.cluster.local.", "10.1.2.3")],
    ),
    ("no VIP on the client's network: empty", "nw2-only.ns1.svc.cluster.local.", "A", []),
    (
        "only the VIP on the client's network",
        "both-networks.ns1.svc.cluster.local.",
        "A",
        [a("both-networks.ns1.svc.cluster.local.", "21.21.21.21")],
    ),
    (
        "headless service: endpoint IPs for A",
        "headless.ns1.svc.cluster.local.",
        "A",
        [
            a("headless.ns1.svc.cluster.local.", "30.30.30.30"),
            a("headless.ns1.svc.cluster.local.", "31.31.31.31"),
        ],
    ),
    (
        "headless service: endpoint IPs for AAAA",
        "headless.ns1.svc.cluster.local.",
        "AAAA",
        [
            aaaa("headless.ns1.svc.cluster.local.", "2001:db8::30"),
            aaaa("headless.ns1.svc.cluster.local.", "2001:db8::31"),
        ],
    ),
    ("headless short name", "headless.", "A", [a("headless.", "30.30.30.30"), a("headless.", "31.31.31.31")]),
    (
        "IPv6-only headless service answers AAAA",
        "headless-ipv6.ns1.svc.cluster.local.",
        "AAAA",
        [aaaa("headless-ipv6.ns1.svc.cluster.local.", "2001:db8::33")],
    ),
    ("IPv6-only headless service: A is empty", "headless-ipv6.ns1.svc.cluster.local.", "A", []),
    (
        "pod hostname of a headless service is not served (fqdn)",
        "headless.pod0.ns1.svc.cluster.local.",
        "A",
        FORWARD,
    ),
    ("pod hostname of a headless service is not served (name.sub.ns)", "headless.pod0.ns1.", "A", FORWARD),
    (
        "external service without VIPs is forwarded (no endpoints)",
        "headless-no-endpoints.example.com",
        "A",
        FORWARD,
    ),
    ("external service without VIPs is forwarded", "headless.example.com", "A", FORWARD),
    (
        "preferred namespace when the client's has none",
        "preferred.io.",
        "A",
        [a("preferred.io.", "10.10.10.211")],
    ),
    ("the client's namespace first", "everywhere.io.", "A", [a("everywhere.io.", "10.10.10.112")]),
    ("canonical before an arbitrary namespace", "canonical.svc", "A", [a("canonical.svc.", "10.10.10.141")]),
    (
        "the client's namespace before canonical",
        "canonical.with.local",
        "A",
        [a("canonical.with.local.", "10.10.10.150")],
    ),
    (
        "a service visible only in its namespace is not ours to answer",
        "private.ns2.svc.cluster.local.",
        "A",
        FORWARD,
    ),
    (
        "names are case-insensitive; the owner is spelled as asked",
        "ProductPage.NS1.",
        "A",
        [a("ProductPage.NS1.", "9.9.9.9")],
    ),
]


@pytest.mark.parametrize(
    ("host", "qtype", "expected"), [c[1:] for c in LOOKUP_CASES], ids=[c[0] for c in LOOKUP_CASES]
)
def test_lookup(host: str, qtype: str, expected) -> None:
    decision = ask(host, qtype)
    if expected == FORWARD:
        assert isinstance(decision, Forward), decision
        return
    assert isinstance(decision, LocalAnswer), decision
    response = decision.response
    assert response.rcode() == dns.rcode.NOERROR
    assert response.flags & dns.flags.AA and response.flags & dns.flags.RA and response.flags & dns.flags.QR
    assert records(response) == expected
    assert decision.result == (RESULT_SUCCESS if expected else decision.result)


def test_answer_header_mirrors_the_query() -> None:
    request = query("productpage.ns1.", "A", use_edns=0, payload=1232)
    decision = decide(request, CLIENT, VIEW, SETTINGS, random.Random(0))
    assert isinstance(decision, LocalAnswer)
    response = decision.response
    assert response.id == request.message.id
    assert response.question == request.message.question
    assert response.flags & dns.flags.RD  # copied from the query
    assert response.edns == 0 and response.payload == 1232
    assert decision.matched_name == "productpage.ns1.svc.cluster.local"
    assert decision.addresses == (ipaddress.ip_address("9.9.9.9"),)


def test_empty_answers_say_why() -> None:
    no_records = ask("nw2-only.ns1.svc.cluster.local.")
    family = ask("v4only-family.localhost.", "AAAA")
    assert isinstance(no_records, LocalAnswer) and no_records.result == RESULT_NO_RECORDS
    assert isinstance(family, LocalAnswer) and family.result == RESULT_FAMILY_NOT_SUPPORTED


def test_ipv6_disabled_answers_aaaa_with_nothing() -> None:
    settings = DnsSettings(ipv6_enabled=False)
    decision = ask("dual.localhost.", "AAAA", settings=settings)
    assert isinstance(decision, LocalAnswer)
    assert decision.result == RESULT_FAMILY_NOT_SUPPORTED and records(decision.response) == []
    headless = ask("headless.ns1.svc.cluster.local.", "AAAA", settings=settings)
    assert isinstance(headless, LocalAnswer) and records(headless.response) == []


def test_namespace_visibility_follows_the_client() -> None:
    ns2_client = workload("c2", NS2, ("10.0.0.2",))
    decision = ask("private.ns2.svc.cluster.local.", client=ns2_client)
    assert isinstance(decision, LocalAnswer)
    assert records(decision.response) == [a("private.ns2.svc.cluster.local.", "40.40.40.40")]
    # From ns2 the short name `productpage` means productpage.ns2, which does not exist.
    assert isinstance(ask("productpage.", client=ns2_client), Forward)


def test_client_on_another_network_sees_that_networks_vips() -> None:
    nw2_client = workload("c3", NS1, ("10.0.0.3",), network=NW2)
    decision = ask("both-networks.ns1.svc.cluster.local.", client=nw2_client)
    assert isinstance(decision, LocalAnswer)
    assert records(decision.response) == [a("both-networks.ns1.svc.cluster.local.", "22.22.22.22")]


def test_dedicated_mode_uses_its_static_search_list() -> None:
    settings = DnsSettings(search_domains=("corp.example",))
    decision = ask("productpage.ns1.corp.example.", settings=settings)
    assert isinstance(decision, LocalAnswer)
    assert records(decision.response) == [
        cname("productpage.ns1.corp.example.", "productpage.ns1."),
        a("productpage.ns1.", "9.9.9.9"),
    ]
    # The per-pod list is not synthesised in dedicated mode.
    assert isinstance(ask("productpage.ns1.ns1.svc.cluster.local.", settings=settings), Forward)
    assert isinstance(ask("www.google.com.ns1.svc.cluster.local.", settings=settings), Forward)


class ReversingRng(random.Random):
    def shuffle(self, x) -> None:  # type: ignore[override]
        x.reverse()


def test_addresses_are_shuffled_with_the_injected_rng() -> None:
    decision = ask("details.ns2.svc.cluster.remote.", rng=ReversingRng())
    assert isinstance(decision, LocalAnswer)
    assert [str(ip) for ip in decision.addresses] == [
        "14.14.14.14",
        "13.13.13.13",
        "12.12.12.12",
        "11.11.11.11",
    ]
    assert [r.to_text() for r in decision.response.answer[0]] == [str(ip) for ip in decision.addresses]


# -- errors -------------------------------------------------------------------------------------


def test_update_opcode_is_not_implemented() -> None:
    update = dns.update.UpdateMessage("example.com.")
    update.add("host", 300, "A", "1.2.3.4")
    request = parse_request(update.to_wire())
    assert isinstance(request, DnsRequest)
    decision = decide(request, CLIENT, VIEW, SETTINGS, random.Random(0))
    assert decision == Refuse(rcode=dns.rcode.NOTIMP, reason="opcode UPDATE")
    response = refuse_response(request, decision.rcode)
    assert response is not None
    assert response.rcode() == dns.rcode.NOTIMP and response.opcode() == dns.opcode.UPDATE
    assert response.id == update.id and response.flags & dns.flags.QR


def test_a_response_is_a_format_error() -> None:
    message = dns.message.make_response(dns.message.make_query("productpage.ns1.", "A"))
    decision = decide(DnsRequest(message=message), CLIENT, VIEW, SETTINGS, random.Random(0))
    assert isinstance(decision, Refuse) and decision.rcode == dns.rcode.FORMERR and not decision.counted


def test_unknown_client_is_a_server_failure_and_counted() -> None:
    decision = ask("productpage.ns1.", client=None)
    assert decision == Refuse(rcode=dns.rcode.SERVFAIL, reason="unknown source workload", counted=True)
    response = refuse_response(query("productpage.ns1."), decision.rcode)
    assert response is not None and response.rcode() == dns.rcode.SERVFAIL and not response.answer


def test_two_questions_are_a_format_error() -> None:
    message = dns.message.make_query("productpage.ns1.", "A")
    message.question.append(dns.rrset.RRset(dns.name.from_text("example.ns2."), 1, dns.rdatatype.A))
    decision = decide(DnsRequest(message=message), CLIENT, VIEW, SETTINGS, random.Random(0))
    assert isinstance(decision, Refuse) and decision.rcode == dns.rcode.FORMERR


def test_malformed_bytes() -> None:
    assert parse_request(b"\x12") == MalformedRequest(id=None, opcode=0, reason=parse_request(b"\x12").reason)
    assert refuse_response(parse_request(b"\x12"), dns.rcode.FORMERR) is None
    # A header, then a question that runs off the end.
    bad = parse_request(b"\xab\xcd\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07exam")
    assert isinstance(bad, MalformedRequest) and bad.id == 0xABCD
    response = refuse_response(bad, dns.rcode.FORMERR)
    assert response is not None and response.id == 0xABCD and response.rcode() == dns.rcode.FORMERR


@given(st.binary(max_size=600))
def test_parse_request_never_raises(wire: bytes) -> None:
    request = parse_request(wire)
    assert isinstance(request, (DnsRequest, MalformedRequest))
    if isinstance(request, MalformedRequest):
        response = refuse_response(request, dns.rcode.FORMERR)
        if response is not None:
            assert isinstance(encode_response(response, max_bytes=512), bytes)


LABEL = st.from_regex(r"[a-zA-Z0-9*_-]{1,12}", fullmatch=True)


@given(st.lists(LABEL, min_size=0, max_size=8), st.sampled_from(["A", "AAAA", "TXT"]))
def test_decide_always_decides(labels: list[str], qtype: str) -> None:
    host = ".".join(labels) + "."
    decision = ask(host, qtype)
    assert isinstance(decision, (LocalAnswer, Forward, Refuse))
    if isinstance(decision, LocalAnswer):
        assert len(encode_response(decision.response, max_bytes=65535)) > 0


# -- helpers ------------------------------------------------------------------------------------


def labels(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(".") if x)


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("name", ["name.ns1.svc.cluster.local"]),
        ("name.ns2", ["name.ns2.svc.cluster.local", "name.ns2.ns1.svc.cluster.local"]),
        ("name.ns2.svc", ["name.ns2.svc.cluster.local", "name.ns2.svc.svc.cluster.local"]),
        ("name.ns2.not-svc", ["name.ns2.not-svc.svc.cluster.local"]),
        ("pod.sub-domain.ns.svc", ["pod.sub-domain.ns.svc.cluster.local"]),
        ("pod.sub-domain.ns.not-svc", []),
        ("name.ns2.svc.cluster", []),
        ("name.ns2.svc.cluster.local", []),
        ("www.google.com", ["www.google.com.svc.cluster.local"]),
    ],
)
def test_kube_fqdns(host: str, expected: list[str]) -> None:
    assert [".".join(x) for x in kube_fqdns(labels(host), "ns1", "cluster.local")] == expected


def test_wildcards() -> None:
    assert wildcards(("svc1",)) == [("svc1",)]
    assert [".".join(x) for x in wildcards(labels("svc1.ns1.svc.cluster.local"))] == [
        "svc1.ns1.svc.cluster.local",
        "*.ns1.svc.cluster.local",
        "*.svc.cluster.local",
        "*.cluster.local",
        "*.local",
    ]


def test_aliases_of_a_name_with_a_search_domain() -> None:
    got = aliases(labels("productpage.ns1.svc.cluster.local"), "ns1", DnsSettings())
    assert got == [
        Alias(name=labels("productpage.ns1.svc.cluster.local")),
        # stripping ns1.svc.cluster.local
        Alias(name=("productpage",), stripped=("productpage",)),
        # productpage.ns1.svc.cluster.local again: already there, not repeated
        # stripping svc.cluster.local
        Alias(name=labels("productpage.ns1"), stripped=labels("productpage.ns1")),
        Alias(name=labels("productpage.ns1.ns1.svc.cluster.local"), stripped=labels("productpage.ns1")),
        # stripping cluster.local
        Alias(name=labels("productpage.ns1.svc"), stripped=labels("productpage.ns1.svc")),
        Alias(name=labels("productpage.ns1.svc.svc.cluster.local"), stripped=labels("productpage.ns1.svc")),
    ]


def test_state_view_follows_state_changes() -> None:
    state = make_state()
    view = StateView(state)
    assert isinstance(decide(query("late.ns1."), CLIENT, view, SETTINGS, random.Random(0)), Forward)
    upsert(state, svc(kube_fqdn("late", NS1), vips=((NW1, "50.50.50.50"),)))
    decision = decide(query("late.ns1."), CLIENT, view, SETTINGS, random.Random(0))
    assert isinstance(decision, LocalAnswer) and records(decision.response) == [a("late.ns1.", "50.50.50.50")]
    assert repr(view) == f"<StateView v{state.version}: {len(SERVICES) - 4} hostnames indexed>"


# -- encoding -----------------------------------------------------------------------------------


def test_large_udp_reply_is_truncated_and_tcp_is_not() -> None:
    request = query("large.com.")
    upstream = dns.message.make_response(request.message)
    rrset = dns.rrset.from_text("large.com.", 30, "IN", "A", *[f"240.0.0.{i}" for i in range(256)])
    upstream.answer.append(rrset)
    response = forwarded_response(request, upstream)
    assert not response.flags & dns.flags.AA and response.flags & dns.flags.RA
    udp = dns.message.from_wire(encode_response(response, max_bytes=udp_limit(request)))
    assert udp.flags & dns.flags.TC and len(encode_response(response, max_bytes=udp_limit(request))) <= 512
    tcp = dns.message.from_wire(encode_response(response, max_bytes=65535))
    assert not tcp.flags & dns.flags.TC and len(tcp.answer[0]) == 256


def test_udp_limit_follows_edns() -> None:
    assert udp_limit(query("x.", use_edns=0, payload=1232)) == 1232
    assert udp_limit(query("x.", use_edns=0, payload=100)) == 512
    assert udp_limit(query("x.")) == 512
