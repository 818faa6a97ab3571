"""Host-side rules that let kubelet probes reach ambient pods without going through the proxy.

Counterparts: istio-cni's CreateHostRulesForHealthChecks / DeleteHostRules (iptables.go,
nftables.go), its ipset / nft-set managers (cni/pkg/ipset, cni/pkg/nftables/host_sets.go);
facts from docs/istio-behaviour.md, "Host probe rules" and "In-pod redirection rules".

In the node's netns, TCP that a local process sends to an enrolled pod IP is SNATed to the probe
address (169.254.7.127, or its v6 counterpart); the in-pod rules accept traffic from that address
without redirecting it. Forwarded traffic (kube-proxy, load balancers) keeps its source and is
still captured. iptables tells the two apart with `-m owner --socket-exists`; nft has no such
match, so the nft rule matches the kubelet's uid instead (`skuid`).

Set membership: one set per family (`istio-inpod-probes-v4`/`-v6`), one entry per enrolled pod
IP with the pod UID as its comment. Adding upserts; removing only removes an entry whose comment
is the pod's UID (the IP may already belong to a newer pod). For the iptables backend the set is
a kernel ipset, driven over netlink (pyroute2) as istio-cni does; for nftables it is a named set
in the `inet istio-ambient-nat` table, driven with `nft`.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import ConfigError
from ..host.commands import CommandRunner
from .apply import Backend, PlanAction, RulePlan, RuleStateError, Step, execute_plan, parse_iptables_save
from .inpod import HOST_PROBE_SNAT_IPV4, HOST_PROBE_SNAT_IPV6, IpFamily

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

PROBE_SET_PREFIX = "istio-inpod-probes"
CHAIN_HOST_POSTROUTING = "ISTIO_POSTRT"
NFT_HOST_TABLE = "istio-ambient-nat"
NFT_HOST_CHAIN = "postrouting"
NFT_SNAT_PRIORITY = 100  # srcnat
SET_COMMENT = "pod UIDs of ambient-enrolled pods on this node"
IPSET_MAX_NAME_CHARS = 31  # IPSET_MAXNAMELEN - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class HostProbeConfig:
    ipv6: bool = False
    probe_ipv4: ipaddress.IPv4Address = HOST_PROBE_SNAT_IPV4
    probe_ipv6: ipaddress.IPv6Address = HOST_PROBE_SNAT_IPV6
    set_prefix: str = PROBE_SET_PREFIX
    kubelet_uid: int | None = None  # required by the nftables rule (no --socket-exists in nft)

    def __post_init__(self) -> None:
        if not self.probe_ipv4.is_link_local:
            raise ConfigError(
                "HOST_PROBE_SNAT_IP", f"{self.probe_ipv4} must be a link-local address (169.254/16)"
            )
        if (
            not self.set_prefix
            or len(self.set_prefix) + 3 > IPSET_MAX_NAME_CHARS
            or not all(c.isalnum() or c in "-_" for c in self.set_prefix)
        ):
            raise ConfigError("set_prefix", f"{self.set_prefix!r} is not a usable set name prefix")
        if self.kubelet_uid is not None and not 0 <= self.kubelet_uid <= 0xFFFFFFFF:
            raise ConfigError("kubelet_uid", f"uid {self.kubelet_uid} out of range")

    @property
    def families(self) -> tuple[IpFamily, ...]:
        return (IpFamily.V4, IpFamily.V6) if self.ipv6 else (IpFamily.V4,)

    def set_name(self, family: IpFamily) -> str:
        return f"{self.set_prefix}-v{family.value}"

    def probe_address(self, family: IpFamily) -> str:
        return str(self.probe_ipv4 if family is IpFamily.V4 else self.probe_ipv6)


# --- rendering -----------------------------------------------------------------------------------


def render_host_iptables(cfg: HostProbeConfig, family: IpFamily = IpFamily.V4) -> str:
    """`iptables-restore --noflush` input for the node's probe SNAT (the ipset must exist)."""
    if family not in cfg.families:
        raise ConfigError("AMBIENT_IPV6", "IPv6 host rules requested but IPv6 is disabled")
    return (
        "\n".join(
            [
                f"# ambient-mesh host probe SNAT, IPv{family.value} ({family.restore} --noflush input)",
                "*nat",
                f"-N {CHAIN_HOST_POSTROUTING}",
                # First in POSTROUTING, ahead of any masquerading the primary CNI installs.
                f"-I POSTROUTING 1 -j {CHAIN_HOST_POSTROUTING}",
                # --socket-exists: only locally originated traffic (the kubelet), never forwarded traffic.
                f"-A {CHAIN_HOST_POSTROUTING} -m owner --socket-exists -p tcp -m set --match-set "
                f"{cfg.set_name(family)} dst -j SNAT --to-source {cfg.probe_address(family)}",
                "COMMIT",
            ]
        )
        + "\n"
    )


def render_host_nftables(cfg: HostProbeConfig) -> str:
    """`nft -f` input for the node's probe SNAT: table, sets and the postrouting chain.

    The chain is flushed and refilled; the sets are only created if missing, so re-applying
    keeps their members.
    """
    if cfg.kubelet_uid is None:
        raise ConfigError(
            "kubelet_uid",
            "the nftables host rule needs the kubelet's uid",
            hint="scan /proc for the kubelet (or kubelite, k3s) process and pass its uid",
        )
    table = f"inet {NFT_HOST_TABLE}"
    lines = ["# ambient-mesh host probe SNAT (nft -f input)", f"add table {table}"]
    for family in cfg.families:
        kind = "ipv4_addr" if family is IpFamily.V4 else "ipv6_addr"
        lines.append(f'add set {table} {cfg.set_name(family)} {{ type {kind} ; comment "{SET_COMMENT}" ; }}')
    lines += [
        f"add chain {table} {NFT_HOST_CHAIN} {{ type nat hook postrouting priority {NFT_SNAT_PRIORITY} ; }}",
        f"flush chain {table} {NFT_HOST_CHAIN}",
    ]
    lines += [
        f"add rule {table} {NFT_HOST_CHAIN} meta l4proto tcp skuid {cfg.kubelet_uid} "
        f"{family.nft} daddr @{cfg.set_name(family)} counter snat {family.nft} to {cfg.probe_address(family)}"
        for family in cfg.families
    ]
    return "\n".join(lines) + "\n"


# --- applying the rules --------------------------------------------------------------------------


def plan_host_rules(cfg: HostProbeConfig, backend: Backend, saved: Mapping[IpFamily, str]) -> RulePlan:
    """Pure: delete-then-create of the host rule ("Host probe rules"). `saved` is iptables-save per family."""
    if backend is Backend.NFTABLES:
        return RulePlan(
            backend=backend,
            action=PlanAction.CREATE,
            reason="flush and refill postrouting",
            steps=(
                Step(argv=("nft", "-f", "-"), input=render_host_nftables(cfg), why="host probe SNAT rule"),
            ),
        )
    steps = [*_host_cleanup_steps(saved)]
    steps += [
        Step(
            argv=(family.restore, "-w", "--noflush"),
            input=render_host_iptables(cfg, family),
            why=f"host probe SNAT rule, IPv{family.value}",
        )
        for family in cfg.families
    ]
    action = (
        PlanAction.RECONCILE
        if any(CHAIN_HOST_POSTROUTING in text for text in saved.values())
        else PlanAction.CREATE
    )
    return RulePlan(
        backend=backend, action=action, reason="delete then create ISTIO_POSTRT", steps=tuple(steps)
    )


def _host_cleanup_steps(saved: Mapping[IpFamily, str]) -> list[Step]:
    steps = []
    for family, text in saved.items():
        state = parse_iptables_save(text, family)
        ipt = family.iptables
        for table, chain, args in state.istio_jumps():
            if args[-1:] == (CHAIN_HOST_POSTROUTING,):
                steps.append(
                    Step(
                        argv=(ipt, "-w", "-t", table, "-D", chain, *args),
                        why="remove jump into ISTIO_POSTRT",
                        check=False,
                    )
                )
        for table, chain in state.istio_chains():
            if chain == CHAIN_HOST_POSTROUTING:
                steps += [
                    Step(argv=(ipt, "-w", "-t", table, "-F", chain), why="flush ISTIO_POSTRT", check=False),
                    Step(argv=(ipt, "-w", "-t", table, "-X", chain), why="delete ISTIO_POSTRT", check=False),
                ]
    return steps


def _saved_state(runner: CommandRunner, netns: str | None, cfg: HostProbeConfig) -> dict[IpFamily, str]:
    return {family: runner.run([family.save, "-t", "nat"], netns=netns).text for family in cfg.families}


def apply_host_probe_rules(
    runner: CommandRunner, netns: str | None, cfg: HostProbeConfig, backend: Backend, sets: ProbeSet
) -> RulePlan:
    """Create the probe sets (if missing) and (re)install the SNAT rule in the node netns."""
    sets.ensure()
    saved = _saved_state(runner, netns, cfg) if backend is Backend.IPTABLES else {}
    plan = plan_host_rules(cfg, backend, saved)
    execute_plan(runner, netns, plan)
    return plan


def remove_host_probe_rules(
    runner: CommandRunner,
    netns: str | None,
    cfg: HostProbeConfig,
    backend: Backend,
    sets: ProbeSet | None = None,
) -> RulePlan:
    """Remove the SNAT rule and (when given) destroy the sets, as on a non-upgrade shutdown."""
    if backend is Backend.NFTABLES:
        listed = runner.run(["nft", "list", "tables"], netns=netns).text
        present = f"table inet {NFT_HOST_TABLE}" in listed.splitlines()
        steps = (
            (Step(argv=("nft", "delete", "table", "inet", NFT_HOST_TABLE), why="delete host table"),)
            if present
            else ()
        )
        plan = RulePlan(
            backend=backend, action=PlanAction.REMOVE, reason=f"host table present: {present}", steps=steps
        )
        execute_plan(runner, netns, plan)
        return plan
    cleanup = _host_cleanup_steps(_saved_state(runner, netns, cfg))
    plan = RulePlan(
        backend=backend, action=PlanAction.REMOVE, reason="delete ISTIO_POSTRT", steps=tuple(cleanup)
    )
    execute_plan(runner, netns, plan)
    if sets is not None:
        sets.destroy()
    return plan


# --- set membership ------------------------------------------------------------------------------


class ProbeSet(Protocol):
    """The per-family sets of enrolled pod IPs, each entry commented with its pod UID."""

    def ensure(self) -> None:
        """Create the sets if they do not exist (members of existing sets are kept)."""

    def entries(self) -> dict[IPAddress, str]:
        """Every member of every set, with its comment (the pod UID)."""

    def upsert(self, ip: IPAddress, uid: str) -> None:
        """Add `ip`, or re-comment it if present."""

    def delete(self, ip: IPAddress) -> None: ...

    def flush(self) -> None: ...

    def destroy(self) -> None: ...


def normalize_ip(ip: str | IPAddress) -> IPAddress:
    """The address as the set stores it: v4-mapped v6 addresses become plain v4."""
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def _wanted(cfg: HostProbeConfig, ips: Iterable[str | IPAddress]) -> list[IPAddress]:
    # With IPv6 off, v6 pod addresses are skipped (there is no v6 set), as istio-cni does.
    return [ip for ip in map(normalize_ip, ips) if ip.version == 4 or cfg.ipv6]


def add_pod_to_probe_set(
    sets: ProbeSet, cfg: HostProbeConfig, uid: str, ips: Iterable[str | IPAddress]
) -> None:
    for ip in _wanted(cfg, ips):
        sets.upsert(ip, uid)


def remove_pod_from_probe_set(
    sets: ProbeSet, cfg: HostProbeConfig, uid: str, ips: Iterable[str | IPAddress]
) -> list[tuple[IPAddress, str]]:
    """Remove the pod's IPs whose entry carries its UID; return (ip, other uid) left alone."""
    current = sets.entries()
    kept = []
    for ip in _wanted(cfg, ips):
        owner = current.get(ip)
        if owner is None:
            continue
        if owner != uid:
            kept.append((ip, owner))
            continue
        sets.delete(ip)
    return kept


def plan_prune(
    current: Mapping[IPAddress, str], enrolled: Mapping[IPAddress, str], *, complete: bool
) -> list[IPAddress]:
    """Pure: which members to drop after a startup snapshot.

    Nothing is pruned from an incomplete snapshot (some enrolled pod has no IP yet): its IP
    might be one of the members that look stale.
    """
    if not complete:
        return []
    return sorted((ip for ip in current if ip not in enrolled), key=lambda a: (a.version, int(a)))


def sync_probe_set(
    sets: ProbeSet,
    cfg: HostProbeConfig,
    enrolled: Mapping[str, Iterable[str | IPAddress]],
    *,
    complete: bool = True,
) -> list[IPAddress]:
    """Make the sets hold exactly the enrolled pods' IPs (uid -> ips); return what was pruned."""
    wanted = {ip: uid for uid, ips in enrolled.items() for ip in _wanted(cfg, ips)}
    current = sets.entries()
    for ip, uid in wanted.items():
        if current.get(ip) != uid:
            sets.upsert(ip, uid)
    pruned = plan_prune(current, wanted, complete=complete)
    for ip in pruned:
        sets.delete(ip)
    return pruned


# --- nftables sets -------------------------------------------------------------------------------


def parse_nft_set_json(text: str) -> dict[IPAddress, str]:
    """Members of `nft -j list set ...` output, with their comments ('' when none).

    Raises RuleStateError on anything that is not the JSON shape nft prints.
    """
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise RuleStateError(f"nft JSON output is not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("nftables"), list):
        raise RuleStateError("nft JSON output has no `nftables` list")
    members: dict[IPAddress, str] = {}
    for item in doc["nftables"]:
        if not isinstance(item, dict) or "set" not in item:
            continue
        nft_set = item["set"]
        if not isinstance(nft_set, dict):
            raise RuleStateError("nft JSON `set` is not an object")
        elems = nft_set.get("elem", [])
        if not isinstance(elems, list):
            raise RuleStateError("nft JSON `elem` is not a list")
        for elem in elems:
            members.update([_nft_member(elem)])
    return members


def _nft_member(elem: Any) -> tuple[IPAddress, str]:
    comment = ""
    if isinstance(elem, dict):
        inner = elem.get("elem")
        if not isinstance(inner, dict):
            raise RuleStateError(f"nft JSON element {elem!r} has no `elem` object")
        comment = inner.get("comment", "")
        elem = inner.get("val")
        if not isinstance(comment, str):
            raise RuleStateError(f"nft JSON element comment {comment!r} is not a string")
    if not isinstance(elem, str):
        raise RuleStateError(f"nft JSON element {elem!r} is not an address")
    try:
        return ipaddress.ip_address(elem), comment
    except ValueError:
        raise RuleStateError(f"nft JSON element {elem!r} is not an address") from None


def _nft_quote(text: str) -> str:
    if '"' in text or "\\" in text or "\n" in text:
        raise ConfigError("pod uid", f"{text!r} cannot be used as an nft comment")
    return f'"{text}"'


class NftProbeSet:
    """Probe sets as named nft sets in `inet istio-ambient-nat`, driven with `nft` commands."""

    def __init__(self, runner: CommandRunner, netns: str | None, cfg: HostProbeConfig) -> None:
        self.runner = runner
        self.netns = netns
        self.cfg = cfg

    def __repr__(self) -> str:
        where = self.netns or "own netns"
        return f"NftProbeSet({', '.join(self.cfg.set_name(f) for f in self.cfg.families)} in {where})"

    def _nft(self, script: str) -> None:
        self.runner.run(["nft", "-f", "-"], input=script.encode(), netns=self.netns)

    def _set(self, ip: IPAddress) -> str:
        return f"inet {NFT_HOST_TABLE} {self.cfg.set_name(IpFamily.V4 if ip.version == 4 else IpFamily.V6)}"

    def ensure(self) -> None:
        lines = [f"add table inet {NFT_HOST_TABLE}"]
        for family in self.cfg.families:
            kind = "ipv4_addr" if family is IpFamily.V4 else "ipv6_addr"
            lines.append(
                f"add set inet {NFT_HOST_TABLE} {self.cfg.set_name(family)} "
                f'{{ type {kind} ; comment "{SET_COMMENT}" ; }}'
            )
        self._nft("\n".join(lines) + "\n")

    def entries(self) -> dict[IPAddress, str]:
        members: dict[IPAddress, str] = {}
        for family in self.cfg.families:
            out = self.runner.run(
                ["nft", "-j", "list", "set", "inet", NFT_HOST_TABLE, self.cfg.set_name(family)],
                netns=self.netns,
            )
            members.update(parse_nft_set_json(out.text))
        return members

    def upsert(self, ip: IPAddress, uid: str) -> None:
        current = self.entries().get(ip)
        if current == uid:
            return
        script = f"delete element {self._set(ip)} {{ {ip} }}\n" if current is not None else ""
        script += f"add element {self._set(ip)} {{ {ip} comment {_nft_quote(uid)} }}\n"
        self._nft(script)

    def delete(self, ip: IPAddress) -> None:
        self._nft(f"delete element {self._set(ip)} {{ {ip} }}\n")

    def flush(self) -> None:
        self._nft(
            "".join(f"flush set inet {NFT_HOST_TABLE} {self.cfg.set_name(f)}\n" for f in self.cfg.families)
        )

    def destroy(self) -> None:
        listed = self.runner.run(["nft", "list", "tables"], netns=self.netns).text
        if f"table inet {NFT_HOST_TABLE}" in listed.splitlines():
            self._nft(f"delete table inet {NFT_HOST_TABLE}\n")


# --- kernel ipsets (iptables backend) ------------------------------------------------------------


class NetlinkIpset:
    """Probe sets as kernel ipsets (`hash:ip` with comments), over netlink with pyroute2.

    `netns` is a named namespace; the netlink socket is opened inside it, and every later call
    on this object acts there. Close it when done (or use it as a context manager).
    """

    def __init__(self, cfg: HostProbeConfig, netns: str | None = None) -> None:
        from pyroute2.ipset import IPSet  # netlink is only needed where this backend is used

        from ..host.netns import entered

        self.cfg = cfg
        self.netns = netns
        if netns is None:
            self._ipset = IPSet()
        else:
            with entered(netns):
                self._ipset = IPSet()

    def __repr__(self) -> str:
        where = self.netns or "own netns"
        return f"NetlinkIpset({', '.join(self.cfg.set_name(f) for f in self.cfg.families)} in {where})"

    def __enter__(self) -> NetlinkIpset:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._ipset.close()

    @staticmethod
    def _af(family: IpFamily) -> int:
        return socket.AF_INET if family is IpFamily.V4 else socket.AF_INET6

    def _name(self, ip: IPAddress) -> tuple[str, int]:
        family = IpFamily.V4 if ip.version == 4 else IpFamily.V6
        return self.cfg.set_name(family), self._af(family)

    def ensure(self) -> None:
        for family in self.cfg.families:
            self._ipset.create(
                self.cfg.set_name(family),
                stype="hash:ip",
                family=self._af(family),
                exclusive=False,
                comment=True,
            )

    def entries(self) -> dict[IPAddress, str]:
        members: dict[IPAddress, str] = {}
        for family in self.cfg.families:
            for msg in self._ipset.list(self.cfg.set_name(family)):
                adt = msg.get_attr("IPSET_ATTR_ADT")
                if adt is None:
                    continue
                for data in adt.get_attrs("IPSET_ATTR_DATA"):
                    ip_from = data.get_attr("IPSET_ATTR_IP_FROM")
                    text = ip_from.get_attr("IPSET_ATTR_IPADDR_IPV4") or ip_from.get_attr(
                        "IPSET_ATTR_IPADDR_IPV6"
                    )
                    members[ipaddress.ip_address(text)] = data.get_attr("IPSET_ATTR_COMMENT") or ""
        return members

    def upsert(self, ip: IPAddress, uid: str) -> None:
        name, af = self._name(ip)
        self._ipset.add(name, str(ip), family=af, comment=uid, exclusive=False)

    def delete(self, ip: IPAddress) -> None:
        name, af = self._name(ip)
        self._ipset.delete(name, str(ip), family=af)

    def flush(self) -> None:
        for family in self.cfg.families:
            self._ipset.flush(self.cfg.set_name(family))

    def destroy(self) -> None:
        for family in self.cfg.families:
            try:
                self._ipset.destroy(self.cfg.set_name(family))
            except Exception as e:  # pyroute2 raises NetlinkError(ENOENT) for a missing set
                if getattr(e, "code", None) != 2:
                    raise
