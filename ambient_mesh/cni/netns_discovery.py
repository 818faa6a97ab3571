"""Find a running pod's network namespace by scanning /proc.

Counterpart of istio-cni's podcgroupns_linux.go (docs/istio-behaviour.md, "Node agent pod lifecycle"): when a
pod is enrolled after it started (a label change) or when the agent restarts, there is no CNI event to say
where the pod's netns is, so every process's `/proc/<pid>/ns/net` is a candidate.

Guards, from the node-breaking bug istio/istio#55139 (rules landed in the host netns because a
CRI-O `conmon` process looked like the pod): the host's netns and the agent's own netns are never
candidates, and a candidate only counts for a pod when one of the pod's IPs is configured on an
interface inside it. The pod UID in the process's cgroup path, when there is one, must agree too.
Each namespace is considered once (deduplicated by device and inode); when several processes
share it, the oldest (field 22 `starttime` of `/proc/<pid>/stat`) stands for it. Pods without
IPs are not matched (deferred): an IP is the only proof of ownership.

Reading /proc is the only I/O in `scan_candidates`; `match_pods` is pure given the addresses of
each candidate, which the `AddressProbe` reads (`ip -j addr` inside the netns).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..errors import ProtocolError
from ..host.commands import CommandError, CommandRunner

log = logging.getLogger("ambient_mesh.cni-agent")

# pod<uuid> in cgroupfs (`kubepods/besteffort/pod1234-...`) and systemd
# (`kubepods-besteffort-pod1234_5678....slice`) layouts.
_POD_UID_RE = re.compile(
    r"pod([0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12})"
)
KUBELET_NAMES = frozenset({"kubelet", "kubelite", "k3s"})


@dataclass(frozen=True, slots=True, kw_only=True)
class NetnsCandidate:
    """One distinct network namespace found under /proc, through its oldest process."""

    pid: int
    path: str
    dev: int
    inode: int
    starttime: int
    pod_uid: str = ""  # from the cgroup path, when the process is in a pod's cgroup

    @property
    def key(self) -> tuple[int, int]:
        return (self.dev, self.inode)


def parse_starttime(stat_text: str) -> int:
    """Field 22 of /proc/<pid>/stat. `comm` (field 2) may hold spaces and parentheses, so
    fields are counted after its last ')'. ProtocolError when the text is not a stat line."""
    close = stat_text.rfind(")")
    if close < 0:
        raise ProtocolError("stat line has no command field")
    fields = stat_text[close + 1 :].split()
    # fields[0] is field 3 (state): starttime, field 22, is fields[19].
    if len(fields) < 20 or not fields[19].isdigit():
        raise ProtocolError("stat line too short for starttime")
    return int(fields[19])


def pod_uid_from_cgroup(text: str) -> str:
    """The pod UID in a /proc/<pid>/cgroup file, '' when none; lines naming different pods give ''."""
    found = {m.group(1).replace("_", "-").lower() for m in _POD_UID_RE.finditer(text)}
    return found.pop() if len(found) == 1 else ""


def parse_ip_addr_json(text: str) -> set[str]:
    """Every address of `ip -j addr` output, canonical text. ProtocolError on anything else."""
    try:
        links = json.loads(text or "[]")
    except ValueError as exc:
        raise ProtocolError(f"`ip -j addr` output is not JSON: {exc}") from None
    if not isinstance(links, list):
        raise ProtocolError("`ip -j addr` output is not a list")
    out: set[str] = set()
    for link in links:
        if not isinstance(link, dict):
            continue
        for info in link.get("addr_info") or []:
            if isinstance(info, dict) and isinstance(info.get("local"), str):
                try:
                    out.add(str(ipaddress.ip_address(info["local"].split("%", 1)[0])))
                except ValueError:
                    continue
    return out


def _ns_key(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def scan_candidates(
    proc_root: str | Path, *, exclude: Iterable[tuple[int, int]] = ()
) -> list[NetnsCandidate]:
    """One candidate per distinct netns under `proc_root` (not in `exclude`), oldest process first."""
    excluded = set(exclude)
    best: dict[tuple[int, int], NetnsCandidate] = {}
    root = Path(proc_root)
    try:
        entries = [e for e in os.listdir(root) if e.isdigit()]
    except OSError as exc:
        log.warning("cannot list %s: %s", root, exc)
        return []
    for entry in entries:
        path = f"{root}/{entry}/ns/net"
        key = _ns_key(path)
        if key is None or key in excluded:
            continue  # gone already, not ours to read, or the host/agent netns
        try:
            starttime = parse_starttime((root / entry / "stat").read_text())
        except (OSError, ProtocolError):
            continue
        try:
            uid = pod_uid_from_cgroup((root / entry / "cgroup").read_text())
        except OSError:
            uid = ""
        current = best.get(key)
        if current is None or (starttime, int(entry)) < (current.starttime, current.pid):
            best[key] = NetnsCandidate(
                pid=int(entry),
                path=path,
                dev=key[0],
                inode=key[1],
                starttime=starttime,
                pod_uid=uid or (current.pod_uid if current else ""),
            )
    return sorted(best.values(), key=lambda c: (c.starttime, c.pid))


def match_pods(
    candidates: Iterable[NetnsCandidate],
    wanted: Mapping[str, Iterable[str]],
    addresses: Callable[[NetnsCandidate], set[str]],
) -> dict[str, NetnsCandidate]:
    """Pure given `addresses`: pod uid -> its netns, for pods whose IP is inside exactly one netns.

    A candidate whose cgroup names a different pod is not taken for this one (it belongs to a
    pod that shares the IP space, e.g. a stale sandbox); one whose cgroup names this pod is
    preferred over those without a cgroup. Otherwise the IP is the only proof, and it proves
    nothing when it is held twice: a pod whose IP is in more than one namespace, or in one that
    also holds another wanted pod's IP, is not matched (logged). Taking the oldest instead put a
    pod's rules and proxy into another pod's namespace whenever another lab on the same host, a
    nested cluster or a stale sandbox held the same address (istio/istio#55139 is the same
    lesson for the host netns). So every candidate is probed, not only until each pod has one.
    """
    want = {uid: {str(ipaddress.ip_address(ip)) for ip in ips} for uid, ips in wanted.items()}
    want = {uid: ips for uid, ips in want.items() if ips}  # no IP, no proof: deferred
    holders: dict[str, list[NetnsCandidate]] = {uid: [] for uid in want}
    for cand in candidates:
        open_uids = [uid for uid in want if not cand.pod_uid or cand.pod_uid == uid]
        if not open_uids:
            continue
        addrs = addresses(cand)
        for uid in open_uids:
            if want[uid] & addrs:
                holders[uid].append(cand)
    claims: dict[tuple[int, int], int] = {}
    for cands in holders.values():
        for cand in cands:
            claims[cand.key] = claims.get(cand.key, 0) + 1
    found: dict[str, NetnsCandidate] = {}
    for uid, cands in holders.items():
        proven = [c for c in cands if c.pod_uid == uid] or cands
        if len(proven) == 1 and claims[proven[0].key] == 1:
            found[uid] = proven[0]
        elif proven:
            log.warning(
                "pod %s: its IPs %s are held by %s, not by one namespace of its own: none is taken "
                "for it (check for another node's or lab's pod, or a stale sandbox, with the same address)",
                uid,
                ", ".join(sorted(want[uid])),
                "; ".join(
                    f"{c.path} (inode {c.inode}"
                    + (", also another pod's address" if claims[c.key] > 1 else "")
                    + ")"
                    for c in proven
                ),
            )
    return found


class AddressProbe(Protocol):
    def addresses(self, netns_path: str) -> set[str]: ...


class IpCommandProbe:
    """The addresses inside a netns, read with `ip -j addr` run there."""

    __slots__ = ("runner",)

    def __init__(self, runner: CommandRunner) -> None:
        self.runner = runner

    def __repr__(self) -> str:
        return f"IpCommandProbe({self.runner!r})"

    def addresses(self, netns_path: str) -> set[str]:
        try:
            result = self.runner.run(["ip", "-j", "addr", "show"], netns=netns_path, check=False)
        except CommandError:
            return set()
        if not result.ok:
            return set()
        try:
            return parse_ip_addr_json(result.text)
        except ProtocolError:
            return set()


class NetnsFinder:
    """Finds pods' network namespaces under a /proc tree (the node's, or `/host/proc`)."""

    def __init__(
        self,
        probe: AddressProbe,
        *,
        proc_root: str | Path = "/proc",
        host_netns_path: str = "/proc/1/ns/net",
        own_netns_path: str = "/proc/self/ns/net",
    ) -> None:
        self.probe = probe
        self.proc_root = Path(proc_root)
        # Read once at start, as istio-cni does: these never change for a running agent.
        self.excluded = {k for k in (_ns_key(host_netns_path), _ns_key(own_netns_path)) if k is not None}
        self.scans = 0

    def __repr__(self) -> str:
        return f"NetnsFinder({self.proc_root}, {len(self.excluded)} namespaces excluded, {self.scans} scans)"

    def find(self, wanted: Mapping[str, Iterable[str]]) -> dict[str, NetnsCandidate]:
        """uid -> netns for each wanted pod (uid -> its IPs) found; the others are absent."""
        if not wanted:
            return {}
        self.scans += 1
        candidates = scan_candidates(self.proc_root, exclude=self.excluded)
        cache: dict[tuple[int, int], set[str]] = {}

        def addresses(cand: NetnsCandidate) -> set[str]:
            if cand.key not in cache:
                cache[cand.key] = self.probe.addresses(cand.path)
            return cache[cand.key]

        found = match_pods(candidates, wanted, addresses)
        for uid in wanted:
            if uid not in found:
                log.info("no netns found under %s for pod %s", self.proc_root, uid)
        return found


def find_kubelet_uid(proc_root: str | Path = "/proc") -> int | None:
    """The uid the kubelet runs as (the nftables host rule matches it; nft has no --socket-exists)."""
    root = Path(proc_root)
    try:
        entries = [e for e in os.listdir(root) if e.isdigit()]
    except OSError:
        return None
    for entry in sorted(entries, key=int):
        try:
            if (root / entry / "comm").read_text().strip() not in KUBELET_NAMES:
                continue
            for line in (root / entry / "status").read_text().splitlines():
                if line.startswith("Uid:"):
                    return int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return None


__all__ = [
    "AddressProbe",
    "IpCommandProbe",
    "NetnsCandidate",
    "NetnsFinder",
    "find_kubelet_uid",
    "match_pods",
    "parse_ip_addr_json",
    "parse_starttime",
    "pod_uid_from_cgroup",
    "scan_candidates",
]
