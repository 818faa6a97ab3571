"""In-pod redirection rules for shared (ambient) mode, rendered for iptables and for nftables.

Counterparts: istio-cni's `cni/pkg/iptables/iptables.go` (AppendInpodRules) and
`cni/pkg/nftables/nftables.go`, facts in docs/istio-behaviour.md, "In-pod redirection rules". The node
agent installs these inside each enrolled pod's network namespace; the node proxy then opens its listeners
there (15001 outbound, 15006 inbound plaintext, 15008 HBONE, 15053 DNS) and marks every socket it owns with
SO_MARK 1337 (0x539).

Everything here is pure: `render_iptables` gives `iptables-restore --noflush` input for one IP
family, `render_nftables` gives `nft -f` input for the three `inet` tables, and
`routing_commands` gives the `ip` commands for the policy route ("Routing" in that section). Applying,
removing and reconciling live in `apply.py`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..errors import ConfigError
from ..metadata import ANNOTATION_BYPASS_INBOUND, ANNOTATION_DNS_CAPTURE, ANNOTATION_VIRTUAL_INTERFACES
from ..ports import DNS_CAPTURE_PORT, DNS_PORT, HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT

# docs/istio-behaviour.md, "Node agent configuration" and "In-pod redirection rules"
INPOD_MARK = 0x539  # ztunnel's SO_MARK 1337 on every socket it opens in the pod
INPOD_MASK = 0xFFF
INPOD_TPROXY_MARK = 0x111  # connmark: "ztunnel touched this connection"
INPOD_TPROXY_MASK = 0xFFF
INPOD_RESTORE_MASK = 0xFFFFFFFF
ROUTE_TABLE_INBOUND = 100
MARK_RULE_PRIORITY = 32764

DNS_CONNTRACK_ZONE = 1  # separate zone for ztunnel <-> upstream DNS (istio/istio#33469)

HOST_PROBE_SNAT_IPV4 = ipaddress.IPv4Address("169.254.7.127")  # HOST_PROBE_SNAT_IP
HOST_PROBE_SNAT_IPV6 = ipaddress.IPv6Address(
    "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"
)  # HOST_PROBE_SNAT_IPV6

CHAIN_PREROUTING = "ISTIO_PRERT"
CHAIN_OUTPUT = "ISTIO_OUTPUT"
ISTIO_CHAIN_PREFIX = "ISTIO_"

NFT_NAT_TABLE = "istio-ambient-nat"
NFT_MANGLE_TABLE = "istio-ambient-mangle"
NFT_RAW_TABLE = "istio-ambient-raw"
NFT_TABLES = (NFT_NAT_TABLE, NFT_MANGLE_TABLE, NFT_RAW_TABLE)
NFT_CHAIN_PREROUTING = "istio-prerouting"
NFT_CHAIN_OUTPUT = "istio-output"

# Pod annotations that change the rules (docs/istio-behaviour.md, "Ambient enablement" and
# "In-pod redirection rules").


IFNAME_MAX_CHARS = 15  # IFNAMSIZ - 1
# Interface names end up inside rule text: allow only what Linux names look like in practice,
# so a hostile annotation cannot smuggle extra rule syntax into iptables-restore or nft input.
_IFNAME = re.compile(r"^[A-Za-z0-9_.@:+-]{1,15}$")

# Go's strconv.ParseBool, which istio-cni uses for the boolean annotations.
_GO_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_GO_FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})


class IpFamily(Enum):
    V4 = 4
    V6 = 6

    @property
    def iptables(self) -> str:
        return "iptables" if self is IpFamily.V4 else "ip6tables"

    @property
    def restore(self) -> str:
        return f"{self.iptables}-restore"

    @property
    def save(self) -> str:
        return f"{self.iptables}-save"

    @property
    def localhost(self) -> str:
        # istio-cni substitutes ::1/128 for 127.0.0.1/32 in the v6 rule set (3.1)
        return "127.0.0.1/32" if self is IpFamily.V4 else "::1/128"

    @property
    def version(self) -> int:
        return self.value

    @property
    def loopback_net(self) -> str:
        # The whole loopback network: traffic to any 127/8 address stays local.
        return "127.0.0.0/8" if self is IpFamily.V4 else "::1/128"

    @property
    def local_default(self) -> str:
        return "0.0.0.0/0" if self is IpFamily.V4 else "::/0"

    @property
    def nft(self) -> str:
        return "ip" if self is IpFamily.V4 else "ip6"


class PodDns(Enum):
    """The pod's `ambient.istio.io/dns-capture` annotation: unset defers to AMBIENT_DNS_CAPTURE."""

    UNSET = "unset"
    ENABLED = "enabled"
    DISABLED = "disabled"


def parse_go_bool(text: str) -> bool | None:
    """Go's strconv.ParseBool; None where Go would return an error (istio-cni then ignores it)."""
    if text in _GO_TRUE:
        return True
    if text in _GO_FALSE:
        return False
    return None


def check_ifname(name: str) -> str:
    if not _IFNAME.match(name) or name in (".", ".."):
        raise ConfigError(ANNOTATION_VIRTUAL_INTERFACES, f"{name!r} is not a valid interface name")
    return name


@dataclass(frozen=True, slots=True, kw_only=True)
class PodLevelOverrides:
    """Per-pod changes to the rule set, from the pod's annotations (istio-cni PodLevelOverrides)."""

    virtual_interfaces: tuple[str, ...] = ()
    ingress_mode: bool = False  # bypass-inbound-capture: no inbound redirection at all
    dns: PodDns = PodDns.UNSET

    @classmethod
    def from_annotations(cls, annotations: Mapping[str, str]) -> PodLevelOverrides:
        """Read the three annotations. Unparsable booleans are ignored, as istio-cni does;
        a virtual interface name that could not be an interface raises ConfigError."""
        ingress = parse_go_bool(annotations.get(ANNOTATION_BYPASS_INBOUND, "")) is True
        dns_value = parse_go_bool(annotations.get(ANNOTATION_DNS_CAPTURE, ""))
        dns = PodDns.UNSET if dns_value is None else (PodDns.ENABLED if dns_value else PodDns.DISABLED)
        raw = annotations.get(ANNOTATION_VIRTUAL_INTERFACES, "")
        names = tuple(check_ifname(part.strip()) for part in raw.split(",") if part.strip())
        return cls(virtual_interfaces=names, ingress_mode=ingress, dns=dns)


@dataclass(frozen=True, slots=True, kw_only=True)
class InpodConfig:
    """Everything that shapes one pod's rule set, resolved (global config + pod overrides)."""

    redirect_dns: bool = True
    ipv6: bool = False
    ingress_mode: bool = False
    virtual_interfaces: tuple[str, ...] = ()
    probe_ipv4: ipaddress.IPv4Address = HOST_PROBE_SNAT_IPV4
    probe_ipv6: ipaddress.IPv6Address = HOST_PROBE_SNAT_IPV6
    outbound_port: int = OUTBOUND_PORT
    inbound_plaintext_port: int = INBOUND_PLAINTEXT_PORT
    hbone_port: int = HBONE_PORT
    dns_port: int = DNS_CAPTURE_PORT
    mark: int = INPOD_MARK
    mark_mask: int = INPOD_MASK
    connmark: int = INPOD_TPROXY_MARK
    connmark_mask: int = INPOD_TPROXY_MASK
    route_table: int = ROUTE_TABLE_INBOUND
    rule_priority: int = MARK_RULE_PRIORITY

    def __post_init__(self) -> None:
        for name in ("outbound_port", "inbound_plaintext_port", "hbone_port", "dns_port"):
            port = getattr(self, name)
            if not 1 <= port <= 65535:
                raise ConfigError(name, f"port {port} out of range 1-65535")
        for name in ("mark", "mark_mask", "connmark", "connmark_mask"):
            value = getattr(self, name)
            if not 0 < value <= 0xFFFFFFFF:
                raise ConfigError(name, f"{value:#x} must be a non-zero 32-bit value")
        if not ipaddress.ip_address(self.probe_ipv4).is_link_local:
            raise ConfigError(
                "HOST_PROBE_SNAT_IP", f"{self.probe_ipv4} must be a link-local address (169.254/16)"
            )
        if not isinstance(self.probe_ipv6, ipaddress.IPv6Address):
            raise ConfigError("HOST_PROBE_SNAT_IPV6", f"{self.probe_ipv6!r} is not an IPv6 address")
        for ifname in self.virtual_interfaces:
            check_ifname(ifname)

    @classmethod
    def for_pod(
        cls,
        *,
        dns_capture: bool,
        ipv6: bool,
        overrides: PodLevelOverrides = PodLevelOverrides(),
        **kwargs: Any,
    ) -> InpodConfig:
        """Resolve the global AMBIENT_DNS_CAPTURE / AMBIENT_IPV6 against one pod's overrides."""
        redirect_dns = {PodDns.UNSET: dns_capture, PodDns.ENABLED: True, PodDns.DISABLED: False}[
            overrides.dns
        ]
        return cls(
            redirect_dns=redirect_dns,
            ipv6=ipv6,
            ingress_mode=overrides.ingress_mode,
            virtual_interfaces=overrides.virtual_interfaces,
            **kwargs,
        )

    @property
    def families(self) -> tuple[IpFamily, ...]:
        return (IpFamily.V4, IpFamily.V6) if self.ipv6 else (IpFamily.V4,)

    def probe_address(self, family: IpFamily) -> str:
        return str(self.probe_ipv4 if family is IpFamily.V4 else self.probe_ipv6)

    def describe(self) -> str:
        parts = [f"dns={'on' if self.redirect_dns else 'off'}", f"ipv6={'on' if self.ipv6 else 'off'}"]
        if self.ingress_mode:
            parts.append("ingress-mode")
        if self.virtual_interfaces:
            parts.append(f"virtual-interfaces={','.join(self.virtual_interfaces)}")
        return " ".join(parts)


# --- iptables ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class IptablesRule:
    """One `-A` line: `table`, `chain` and the match/target arguments after the chain name."""

    table: str
    chain: str
    args: tuple[str, ...]

    @property
    def line(self) -> str:
        return " ".join(("-A", self.chain, *self.args))


@dataclass(frozen=True, slots=True, kw_only=True)
class IptablesRuleSet:
    """The rule set of one family: our chains per table, then every rule in application order."""

    family: IpFamily
    chains: Mapping[str, tuple[str, ...]]  # table -> chains we create there (ordered)
    rules: tuple[IptablesRule, ...]

    @property
    def tables(self) -> tuple[str, ...]:
        return tuple(sorted(self.chains))

    def rules_in(self, table: str) -> tuple[IptablesRule, ...]:
        return tuple(rule for rule in self.rules if rule.table == table)

    def render(self) -> str:
        lines = [
            f"# ambient-mesh in-pod redirection, IPv{self.family.value} "
            f"({self.family.restore} --noflush input)"
        ]
        for table in self.tables:
            lines.append(f"*{table}")
            lines += [f"-N {chain}" for chain in self.chains[table]]
            lines += [rule.line for rule in self.rules_in(table)]
            lines.append("COMMIT")
        return "\n".join(lines) + "\n"


def _hex(value: int) -> str:
    return f"{value:#x}"


def iptables_rule_set(cfg: InpodConfig, family: IpFamily) -> IptablesRuleSet:
    """The in-pod rules of docs/istio-behaviour.md, "In-pod redirection rules" for one family, in istio-cni's
    order."""
    mark = f"{_hex(cfg.mark)}/{_hex(cfg.mark_mask)}"
    connmark = f"{_hex(cfg.connmark)}/{_hex(cfg.connmark_mask)}"
    localhost = family.localhost
    probe = cfg.probe_address(family)
    rules: list[IptablesRule] = []

    def add(table: str, chain: str, *args: str) -> None:
        rules.append(IptablesRule(table=table, chain=chain, args=args))

    # Jumps from the built-in chains; everything else lives in our own chains so that removal
    # is exact and never touches anyone else's rules.
    add("mangle", "PREROUTING", "-j", CHAIN_PREROUTING)
    add("mangle", "OUTPUT", "-j", CHAIN_OUTPUT)
    add("nat", "OUTPUT", "-j", CHAIN_OUTPUT)
    if cfg.redirect_dns:
        add("raw", "PREROUTING", "-j", CHAIN_PREROUTING)
        add("raw", "OUTPUT", "-j", CHAIN_OUTPUT)
    add("nat", "PREROUTING", "-j", CHAIN_PREROUTING)

    # Virtual interfaces (KubeVirt, DinD): their "inbound" is really the pod's outbound, so it is
    # short-circuited to the outbound listener before any other inbound rule sees it.
    for ifname in cfg.virtual_interfaces:
        add(
            "nat",
            CHAIN_PREROUTING,
            "-i",
            ifname,
            "-p",
            "tcp",
            "-j",
            "REDIRECT",
            "--to-ports",
            str(cfg.outbound_port),
        )
        add("nat", CHAIN_PREROUTING, "-i", ifname, "-p", "tcp", "-j", "RETURN")

    # Packets carrying ztunnel's mark tag their connection, so replies can be recognised. Kept in
    # ingress mode too: eliding it broke inbound HBONE (istio/istio#58546, fixed by #58577).
    add("mangle", CHAIN_PREROUTING, "-m", "mark", "--mark", mark, "-j", "CONNMARK", "--set-xmark", connmark)

    if not cfg.ingress_mode:
        # Kubelet probes, SNATed to the probe address on the node, bypass ztunnel.
        add("nat", CHAIN_PREROUTING, "-s", probe, "-p", "tcp", "-m", "tcp", "-j", "ACCEPT")
    # ... and so does everything the pod sends back to the probe address.
    add("nat", CHAIN_OUTPUT, "-d", probe, "-p", "tcp", "-m", "tcp", "-j", "ACCEPT")

    if not cfg.ingress_mode:
        # All other inbound TCP goes to the inbound plaintext listener, except HBONE, which
        # ztunnel accepts directly on its in-pod 15008 listener, and ztunnel's own packets.
        add(
            "nat",
            CHAIN_PREROUTING,
            "!",
            "-d",
            localhost,
            "-p",
            "tcp",
            "!",
            "--dport",
            str(cfg.hbone_port),
            "-m",
            "mark",
            "!",
            "--mark",
            mark,
            "-j",
            "REDIRECT",
            "--to-ports",
            str(cfg.inbound_plaintext_port),
        )

    # Copy the connection's tag back onto its outgoing packets; the fwmark policy route ("Routing")
    # then keeps replies to spoofed-source connections inside the pod.
    add(
        "mangle",
        CHAIN_OUTPUT,
        "-m",
        "connmark",
        "--mark",
        connmark,
        "-j",
        "CONNMARK",
        "--restore-mark",
        "--nfmask",
        _hex(INPOD_RESTORE_MASK),
        "--ctmask",
        _hex(INPOD_RESTORE_MASK),
    )

    if cfg.redirect_dns:
        # DNS to any resolver not on lo goes to ztunnel's DNS proxy, UDP and TCP.
        add(
            "nat",
            CHAIN_OUTPUT,
            "!",
            "-o",
            "lo",
            "-p",
            "udp",
            "-m",
            "mark",
            "!",
            "--mark",
            mark,
            "-m",
            "udp",
            "--dport",
            str(DNS_PORT),
            "-j",
            "REDIRECT",
            "--to-port",
            str(cfg.dns_port),
        )
        add(
            "nat",
            CHAIN_OUTPUT,
            "!",
            "-d",
            localhost,
            "-p",
            "tcp",
            "--dport",
            str(DNS_PORT),
            "-m",
            "mark",
            "!",
            "--mark",
            mark,
            "-j",
            "REDIRECT",
            "--to-ports",
            str(cfg.dns_port),
        )
        # ztunnel <-> upstream resolver packets get their own conntrack zone (istio/istio#33469).
        add(
            "raw",
            CHAIN_OUTPUT,
            "-p",
            "udp",
            "-m",
            "mark",
            "--mark",
            mark,
            "-m",
            "udp",
            "--dport",
            str(DNS_PORT),
            "-j",
            "CT",
            "--zone",
            str(DNS_CONNTRACK_ZONE),
        )
        add(
            "raw",
            CHAIN_PREROUTING,
            "-p",
            "udp",
            "-m",
            "mark",
            "!",
            "--mark",
            mark,
            "-m",
            "udp",
            "--sport",
            str(DNS_PORT),
            "-j",
            "CT",
            "--zone",
            str(DNS_CONNTRACK_ZONE),
        )

    # Connections ztunnel touched are never redirected again.
    add("nat", CHAIN_OUTPUT, "-p", "tcp", "-m", "mark", "--mark", connmark, "-j", "ACCEPT")
    # The app calling its own pod IP leaves through lo: do not loop it through ztunnel.
    add("nat", CHAIN_OUTPUT, "!", "-d", localhost, "-o", "lo", "-j", "ACCEPT")
    # Everything else the app sends over TCP goes to the outbound listener.
    add(
        "nat",
        CHAIN_OUTPUT,
        "!",
        "-d",
        localhost,
        "-p",
        "tcp",
        "-m",
        "mark",
        "!",
        "--mark",
        mark,
        "-j",
        "REDIRECT",
        "--to-ports",
        str(cfg.outbound_port),
    )

    chains: dict[str, tuple[str, ...]] = {}
    for rule in rules:
        if rule.chain.startswith(ISTIO_CHAIN_PREFIX):
            known = chains.setdefault(rule.table, ())
            if rule.chain not in known:
                chains[rule.table] = (*known, rule.chain)
    # a chain we jump to must exist even if (in some override combination) it holds no rules
    for rule in rules:
        if rule.args[:1] == ("-j",) and rule.args[1].startswith(ISTIO_CHAIN_PREFIX):
            known = chains.setdefault(rule.table, ())
            if rule.args[1] not in known:
                chains[rule.table] = (*known, rule.args[1])
    ordered = {
        table: tuple(c for c in (CHAIN_PREROUTING, CHAIN_OUTPUT) if c in chains[table]) for table in chains
    }
    return IptablesRuleSet(family=family, chains=ordered, rules=tuple(rules))


def render_iptables(cfg: InpodConfig, family: IpFamily = IpFamily.V4) -> str:
    """`iptables-restore --noflush` (or `ip6tables-restore`) input for one family."""
    if family is IpFamily.V6 and not cfg.ipv6:
        raise ConfigError("AMBIENT_IPV6", "IPv6 rules requested but IPv6 is disabled for this pod")
    return iptables_rule_set(cfg, family).render()


# --- nftables ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class NftBaseChain:
    name: str
    type: str
    hook: str
    priority: int


# (table, base chains); priorities are the iptables equivalents: dstnat -100, mangle -150, raw -300.
NFT_BASE_CHAINS: Mapping[str, tuple[NftBaseChain, ...]] = {
    NFT_NAT_TABLE: (
        NftBaseChain(name="prerouting", type="nat", hook="prerouting", priority=-100),
        NftBaseChain(name="output", type="nat", hook="output", priority=-100),
    ),
    # `route` type on output: a mark change re-routes the packet, as mangle OUTPUT does.
    NFT_MANGLE_TABLE: (
        NftBaseChain(name="prerouting", type="filter", hook="prerouting", priority=-150),
        NftBaseChain(name="output", type="route", hook="output", priority=-150),
    ),
    NFT_RAW_TABLE: (
        NftBaseChain(name="prerouting", type="filter", hook="prerouting", priority=-300),
        NftBaseChain(name="output", type="filter", hook="output", priority=-300),
    ),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class NftRuleSet:
    """The in-pod nftables rule set: for each of our tables, its rules in order."""

    rules: Mapping[str, tuple[tuple[str, str], ...]]  # table -> ((chain, rule text), ...)

    @property
    def tables(self) -> tuple[str, ...]:
        return tuple(table for table in NFT_TABLES if self.rules.get(table))

    def render(self) -> str:
        lines = ["# ambient-mesh in-pod redirection (nft -f input)"]
        for table in self.tables:
            lines += [f"add table inet {table}", f"flush table inet {table}"]
            for base in NFT_BASE_CHAINS[table]:
                lines.append(
                    f"add chain inet {table} {base.name} "
                    f"{{ type {base.type} hook {base.hook} priority {base.priority} ; }}"
                )
            lines += [
                f"add chain inet {table} {NFT_CHAIN_PREROUTING}",
                f"add chain inet {table} {NFT_CHAIN_OUTPUT}",
            ]
            lines += [f"add rule inet {table} {chain} {text}" for chain, text in self.rules[table]]
        return "\n".join(lines) + "\n"


def nft_rule_set(cfg: InpodConfig) -> NftRuleSet:
    """The rules of docs/istio-behaviour.md, "In-pod redirection rules": the iptables set in three `inet`
    tables.

    One `inet` table serves both families; the v6 variants of address-specific rules are only
    emitted when IPv6 is on for the pod, as ip6tables rules would be.
    """
    mark = f"{_hex(cfg.mark_mask)} != {_hex(cfg.mark)}"
    fams = cfg.families
    nat: list[tuple[str, str]] = []
    mangle: list[tuple[str, str]] = []
    raw: list[tuple[str, str]] = []
    pre, out = NFT_CHAIN_PREROUTING, NFT_CHAIN_OUTPUT

    mangle.append(("prerouting", f"jump {pre}"))
    mangle.append(("output", f"jump {out}"))
    nat.append(("output", f"jump {out}"))
    if cfg.redirect_dns:
        raw.append(("prerouting", f"jump {pre}"))
        raw.append(("output", f"jump {out}"))
    nat.append(("prerouting", f"jump {pre}"))

    for ifname in cfg.virtual_interfaces:
        nat.append((pre, f"iifname {ifname} meta l4proto tcp counter redirect to :{cfg.outbound_port}"))
        nat.append((pre, f"iifname {ifname} meta l4proto tcp counter return"))

    mangle.append(
        (
            pre,
            f"meta mark and {_hex(cfg.mark_mask)} == {_hex(cfg.mark)} counter "
            f"ct mark set ct mark and {_hex(~cfg.connmark_mask & 0xFFFFFFFF)} or {_hex(cfg.connmark)}",
        )
    )
    if not cfg.ingress_mode:
        nat += [(pre, f"meta l4proto tcp {f.nft} saddr {cfg.probe_address(f)} counter accept") for f in fams]
    nat += [(out, f"meta l4proto tcp {f.nft} daddr {cfg.probe_address(f)} counter accept") for f in fams]
    if not cfg.ingress_mode:
        nat += [
            (
                pre,
                f"{f.nft} daddr != {f.localhost} tcp dport != {cfg.hbone_port} meta mark and {mark} "
                f"counter redirect to :{cfg.inbound_plaintext_port}",
            )
            for f in fams
        ]

    mangle.append(
        (out, f"ct mark and {_hex(cfg.connmark_mask)} == {_hex(cfg.connmark)} counter meta mark set ct mark")
    )

    if cfg.redirect_dns:
        nat.append(
            (
                out,
                f"oifname != lo meta mark and {mark} udp dport {DNS_PORT} counter "
                f"redirect to :{cfg.dns_port}",
            )
        )
        nat += [
            (
                out,
                f"{f.nft} daddr != {f.localhost} tcp dport {DNS_PORT} meta mark and {mark} counter "
                f"redirect to :{cfg.dns_port}",
            )
            for f in fams
        ]
        raw.append(
            (
                out,
                f"udp dport {DNS_PORT} meta mark and {_hex(cfg.mark_mask)} == {_hex(cfg.mark)} "
                f"counter ct zone set {DNS_CONNTRACK_ZONE}",
            )
        )
        raw.append(
            (pre, f"udp sport {DNS_PORT} meta mark and {mark} counter ct zone set {DNS_CONNTRACK_ZONE}")
        )

    nat.append(
        (
            out,
            f"meta l4proto tcp meta mark and {_hex(cfg.connmark_mask)} == {_hex(cfg.connmark)} "
            "counter accept",
        )
    )
    nat += [(out, f"oifname lo {f.nft} daddr != {f.localhost} counter accept") for f in fams]
    nat += [
        (
            out,
            f"meta l4proto tcp {f.nft} daddr != {f.localhost} meta mark and {mark} counter "
            f"redirect to :{cfg.outbound_port}",
        )
        for f in fams
    ]

    return NftRuleSet(
        rules={NFT_NAT_TABLE: tuple(nat), NFT_MANGLE_TABLE: tuple(mangle), NFT_RAW_TABLE: tuple(raw)}
    )


def render_nftables(cfg: InpodConfig) -> str:
    """`nft -f` input creating (or flushing and refilling) our in-pod tables."""
    return nft_rule_set(cfg).render()


# --- routing (docs/istio-behaviour.md, "In-pod redirection rules") --------------------------------


def routing_commands(cfg: InpodConfig, *, ipv6_loopback: bool = True) -> tuple[tuple[str, ...], ...]:
    """`ip` commands for the policy route: connmark-tagged packets look up a local-only table.

    `ipv6_loopback=False` (lo has disable_ipv6=1) skips the v6 local route, as istio-cni does.
    """
    commands = []
    for family in cfg.families:
        flag = f"-{family.value}"
        commands.append(
            (
                "ip",
                flag,
                "rule",
                "add",
                "fwmark",
                f"{_hex(cfg.connmark)}/{_hex(cfg.connmark_mask)}",
                "pref",
                str(cfg.rule_priority),
                "lookup",
                str(cfg.route_table),
            )
        )
        if family is IpFamily.V4 or ipv6_loopback:
            commands.append(
                (
                    "ip",
                    flag,
                    "route",
                    "replace",
                    "local",
                    family.local_default,
                    "dev",
                    "lo",
                    "table",
                    str(cfg.route_table),
                )
            )
    return tuple(commands)


def routing_removal_commands(cfg: InpodConfig) -> tuple[tuple[str, ...], ...]:
    """The inverse of `routing_commands`; each may find nothing to delete."""
    commands = []
    for family in cfg.families:
        flag = f"-{family.value}"
        commands.append(
            (
                "ip",
                flag,
                "rule",
                "del",
                "fwmark",
                f"{_hex(cfg.connmark)}/{_hex(cfg.connmark_mask)}",
                "pref",
                str(cfg.rule_priority),
                "lookup",
                str(cfg.route_table),
            )
        )
        commands.append(
            (
                "ip",
                flag,
                "route",
                "del",
                "local",
                family.local_default,
                "dev",
                "lo",
                "table",
                str(cfg.route_table),
            )
        )
    return tuple(commands)
