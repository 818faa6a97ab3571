"""Traffic capture for dedicated mode: iptables rules that hand a workload's TCP to its proxy.

Counterpart: ztunnel's scripts/ztunnel-redirect.sh (dedicated mode, docs/istio-behaviour.md, "Proxy modes"),
with the mark/connmark facts of the in-pod rules (docs/istio-behaviour.md, "In-pod redirection rules").
In dedicated mode the proxy shares the workload's network namespace, like a sidecar:

- nat OUTPUT: the app's TCP goes to the outbound listener (15001), except traffic that leaves
  through `lo` (127/8 and the pod's own IPs) and the proxy's own sockets, which carry the packet
  mark (SO_MARK 1337 = 0x539).
- nat PREROUTING: TCP arriving from the network goes to the inbound plaintext listener (15006),
  except HBONE (15008), which the proxy accepts directly.
- transparent (original-source) delivery: the proxy connects to the app *from the client's IP*.
  The app's replies would then be routed out of the pod, so the connection is tagged (connmark
  0x111) when the proxy's marked packets arrive over lo, the tag is copied back onto the reply
  packets, and a policy route sends packets with that mark to a local-only table.

Rendering is pure (`render_dedicated_rules`); applying and removing go through a CommandRunner.
Everything lives in our own chains (AMBIENT_OUTPUT, AMBIENT_PRERT) so removal is exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..errors import ConfigError
from ..host.commands import CommandRunner
from ..ports import HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT
from .inpod import IpFamily

DEFAULT_MARK = 1337  # 0x539, ztunnel's PACKET_MARK
CONNMARK = 0x111  # istio-cni InpodTProxyMark: "the proxy touched this connection"
MARK_MASK = 0xFFF
ROUTE_TABLE = 100
RULE_PRIORITY = 32764

CHAIN_OUTPUT = "AMBIENT_OUTPUT"
CHAIN_PREROUTING = "AMBIENT_PRERT"
# (table, built-in chain, our chain) for every jump we install; nat only unless transparent.
NAT_JUMPS = (("nat", "OUTPUT", CHAIN_OUTPUT), ("nat", "PREROUTING", CHAIN_PREROUTING))
MANGLE_JUMPS = (("mangle", "OUTPUT", CHAIN_OUTPUT), ("mangle", "PREROUTING", CHAIN_PREROUTING))
MAX_JUMP_DELETES = 16  # a jump appended by a crashed earlier apply may be present more than once


def family_for(ipv6: bool) -> IpFamily:
    return IpFamily.V6 if ipv6 else IpFamily.V4


def _check_port(name: str, port: int) -> None:
    if not 1 <= port <= 65535:
        raise ConfigError(name, f"port {port} out of range 1-65535")


def render_dedicated_rules(
    *,
    mark: int = DEFAULT_MARK,
    outbound_port: int = OUTBOUND_PORT,
    inbound_plaintext_port: int = INBOUND_PLAINTEXT_PORT,
    hbone_port: int = HBONE_PORT,
    exclude_uids: Iterable[int] = (),
    transparent: bool = False,
    ipv6: bool = False,
) -> str:
    """`iptables-restore` (or, with ipv6, `ip6tables-restore`) input for dedicated-mode capture.

    Meant for `--noflush`: only our chains are declared (and so flushed); the jumps into them
    are appended to the built-in chains, which is why applying first removes earlier jumps.
    """
    if not 0 < mark <= 0xFFFFFFFF:
        raise ConfigError("PACKET_MARK", f"mark {mark} must be a non-zero 32-bit value")
    for name, port in (
        ("outbound_port", outbound_port),
        ("inbound_plaintext_port", inbound_plaintext_port),
        ("hbone_port", hbone_port),
    ):
        _check_port(name, port)
    uids = tuple(exclude_uids)
    for uid in uids:
        if not 0 <= uid <= 0xFFFFFFFF:
            raise ConfigError("exclude_uids", f"uid {uid} out of range")
    fam = family_for(ipv6)
    lines = [
        f"# ambient-mesh dedicated-mode capture, IPv{fam.version} ({fam.restore} --noflush input)",
    ]
    if transparent:
        lines += [
            "*mangle",
            f":{CHAIN_OUTPUT} - [0:0]",
            f":{CHAIN_PREROUTING} - [0:0]",
            f"-A PREROUTING -j {CHAIN_PREROUTING}",
            f"-A OUTPUT -j {CHAIN_OUTPUT}",
            # The proxy's marked packets reach the app over lo and pass PREROUTING there: tag
            # the connection so the app's replies can be recognised.
            f"-A {CHAIN_PREROUTING} -m mark --mark {mark:#x} "
            f"-j CONNMARK --set-xmark {CONNMARK:#x}/{MARK_MASK:#x}",
            # Copy the tag onto the app's reply packets; the policy route below keeps them local.
            f"-A {CHAIN_OUTPUT} -m connmark --mark {CONNMARK:#x}/{MARK_MASK:#x} "
            "-j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff",
            "COMMIT",
        ]
    lines += [
        "*nat",
        f":{CHAIN_OUTPUT} - [0:0]",
        f":{CHAIN_PREROUTING} - [0:0]",
        f"-A PREROUTING -j {CHAIN_PREROUTING}",
        f"-A OUTPUT -j {CHAIN_OUTPUT}",
        # Inbound: connections from inside the pod (the proxy delivering to the app) stay put.
        f"-A {CHAIN_PREROUTING} -i lo -j RETURN",
        # HBONE is terminated by the proxy's own listener, never redirected.
        f"-A {CHAIN_PREROUTING} -p tcp --dport {hbone_port} -j RETURN",
        f"-A {CHAIN_PREROUTING} -p tcp -j REDIRECT --to-ports {inbound_plaintext_port}",
        # Outbound: loopback destinations (127/8, ::1 and the pod's own IPs all route via lo).
        f"-A {CHAIN_OUTPUT} -o lo -j RETURN",
        f"-A {CHAIN_OUTPUT} -d {fam.loopback_net} -j RETURN",
        # The proxy's own connections: SO_MARK on every socket it opens.
        f"-A {CHAIN_OUTPUT} -m mark --mark {mark:#x} -j RETURN",
    ]
    if transparent:
        # Defensive, as in the in-pod rules: a connection already tagged is never redirected.
        lines.append(f"-A {CHAIN_OUTPUT} -m connmark --mark {CONNMARK:#x}/{MARK_MASK:#x} -j RETURN")
    lines += [f"-A {CHAIN_OUTPUT} -m owner --uid-owner {uid} -j RETURN" for uid in uids]
    lines += [
        f"-A {CHAIN_OUTPUT} -p tcp -j REDIRECT --to-ports {outbound_port}",
        "COMMIT",
    ]
    if transparent:
        lines += ["# policy routing needed for replies to original-source connections (not iptables):"]
        lines += [f"#   {' '.join(argv)}" for argv in policy_route_commands(ipv6=ipv6)]
    return "\n".join(lines) + "\n"


def policy_route_commands(*, ipv6: bool = False) -> tuple[tuple[str, ...], ...]:
    """The `ip` commands that route connmark-tagged replies back to the proxy via lo."""
    fam = family_for(ipv6)
    flag = f"-{fam.version}"
    return (
        (
            "ip",
            flag,
            "rule",
            "add",
            "fwmark",
            f"{CONNMARK:#x}/{MARK_MASK:#x}",
            "pref",
            str(RULE_PRIORITY),
            "lookup",
            str(ROUTE_TABLE),
        ),
        ("ip", flag, "route", "replace", "local", fam.local_default, "dev", "lo", "table", str(ROUTE_TABLE)),
    )


def apply_dedicated_rules(
    runner: CommandRunner,
    netns: str | None,
    rules: str,
    *,
    ipv6: bool = False,
    policy_routes: bool | None = None,
) -> None:
    """Install rendered rules inside `netns`, replacing any earlier set of ours.

    `netns=None` means the caller's own namespace: the proxy's, when it runs inside the pod.

    `policy_routes` defaults to whether the rules are the transparent set (they carry a mangle
    table); the routes are what make original-source replies find their way back.
    """
    fam = family_for(ipv6)
    remove_dedicated_rules(runner, netns, ipv6=ipv6)
    runner.run([fam.restore, "--noflush"], input=rules.encode(), netns=netns)
    if policy_routes is None:
        policy_routes = "*mangle" in rules.splitlines()
    if policy_routes:
        for argv in policy_route_commands(ipv6=ipv6):
            runner.run(argv, netns=netns)


def _removal_commands(fam: IpFamily, jumps: Sequence[tuple[str, str, str]]) -> list[tuple[str, ...]]:
    return [(fam.iptables, "-t", table, "-D", builtin, "-j", chain) for table, builtin, chain in jumps]


def remove_dedicated_rules(runner: CommandRunner, netns: str | None, *, ipv6: bool = False) -> None:
    """Remove our jumps, chains and policy route, whatever is left of them. Idempotent.

    Every step may find nothing to remove (a fresh namespace, an earlier partial apply), so exit
    codes are ignored here; `apply_dedicated_rules` then fails loudly if the state is still wrong.
    """
    fam = family_for(ipv6)
    for argv in _removal_commands(fam, NAT_JUMPS + MANGLE_JUMPS):
        for _ in range(MAX_JUMP_DELETES):
            if not runner.run(argv, netns=netns, check=False).ok:
                break
    for table, _, chain in NAT_JUMPS + MANGLE_JUMPS:
        runner.run([fam.iptables, "-t", table, "-F", chain], netns=netns, check=False)
        runner.run([fam.iptables, "-t", table, "-X", chain], netns=netns, check=False)
    flag = f"-{fam.version}"
    for _ in range(MAX_JUMP_DELETES):
        if not runner.run(
            [
                "ip",
                flag,
                "rule",
                "del",
                "fwmark",
                f"{CONNMARK:#x}/{MARK_MASK:#x}",
                "lookup",
                str(ROUTE_TABLE),
            ],
            netns=netns,
            check=False,
        ).ok:
            break
    runner.run(["ip", flag, "route", "flush", "table", str(ROUTE_TABLE)], netns=netns, check=False)
