"""ztunnel's `rbac` benchmark in Python: authorization with 10,000 policies x 10 rules.

Counterpart: ztunnel benches/throughput.rs `rbac`. Cases:

  (a) "few": policies spread over 1,000 namespaces (NAMESPACE scope, 10 per namespace) plus a
      handful of WORKLOAD_SELECTOR ones; the destination workload sees about a dozen.
  (b) "global": the same 10,000 policies, all GLOBAL: every one applies to every workload.

Each for an "allow" outcome (one ALLOW matches, and it is the last one looked at) and a "deny"
outcome ("allow policies exist, but none allowed": every policy is evaluated). Paths measured:

  index.check      PolicyIndex.check(workload, conn): the hot path
  evaluate(compiled)  evaluate(index.applicable(workload), conn): compiled, split per call
  evaluate(dict)   evaluate(policies_for(dict, workload), conn): scan every policy and
                   compile the applicable ones on every call (what a plain dict costs)

Every case runs at most --iterations decisions or --seconds seconds, whichever comes first.

    .venv/bin/python bench/rbac_bench.py [--seconds 1.0] [--iterations 100000] [--policies 10000]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ambient_mesh.identity.spiffe import Identity  # noqa: E402
from ambient_mesh.net import ip_address  # noqa: E402
from ambient_mesh.rbac import (  # noqa: E402
    Action,
    Authorization,
    Clause,
    Decision,
    Match,
    PolicyIndex,
    RbacConnection,
    Rule,
    Scope,
    ServiceAccountMatch,
    StringMatch,
    evaluate,
    policies_for,
)

RESULTS = Path(__file__).resolve().parent / "results" / "rbac.json"
RULES_PER_POLICY = 10
NAMESPACES = 1_000
SELECTOR_POLICIES = 4
TARGET_NAMESPACE = "ns-7"


@dataclass(frozen=True)
class Target:
    """The destination workload as policy selection reads it."""

    namespace: str
    authorization_policies: tuple[str, ...] = ()


PEER = Identity("cluster.local", TARGET_NAMESPACE, "client")
CONN = RbacConnection(
    src_identity=PEER, src_ip=ip_address("10.1.2.3"), dst_ip=ip_address("10.7.0.9"), dst_port=8080
)


def miss_rule(i: int, j: int) -> Rule:
    """A rule that does not match CONN, cycling through the match types, some failing late."""
    ns = f"ns-{(i + j) % NAMESPACES}-x"
    kind = (i * RULES_PER_POLICY + j) % 6
    if kind == 0:
        m = Match(principals=(StringMatch.exact(f"cluster.local/ns/{ns}/sa/sa-{j}"),))
    elif kind == 1:
        m = Match(namespaces=(StringMatch.prefix(ns),), destination_ports=(8080, 9000 + j))
    elif kind == 2:
        m = Match(service_accounts=(ServiceAccountMatch(namespace=ns, service_account=f"sa-{j}"),))
    elif kind == 3:
        m = Match(source_ips=(ipaddress.ip_network(f"10.200.{j}.0/24"),), destination_ports=(8080,))
    elif kind == 4:
        # Two clauses: the first holds, the second does not.
        return Rule(
            clauses=(
                Clause(matches=(Match(destination_ports=(8080,)),)),
                Clause(matches=(Match(principals=(StringMatch.suffix(f"/sa/other-{j}"),)),)),
            )
        )
    else:
        m = Match(not_destination_ports=(8080,), destination_ips=(ipaddress.ip_network("10.0.0.0/8"),))
    return Rule(clauses=(Clause(matches=(m,)),))


HIT_RULE = Rule(
    clauses=(
        Clause(matches=(Match(principals=(StringMatch.exact(PEER.principal),), destination_ports=(8080,)),)),
    )
)


def build_policies(count: int, *, scope: Scope, matching_allow: bool) -> tuple[list[Authorization], Target]:
    """`count` non-matching policies (half ALLOW, half DENY), optionally one matching ALLOW last."""
    policies = []
    for i in range(count):
        ns = f"ns-{i % NAMESPACES}"
        policies.append(
            Authorization(
                name=f"policy-{i}",
                namespace="istio-system" if scope is Scope.GLOBAL else ns,
                scope=scope,
                action=Action.DENY if i % 2 else Action.ALLOW,
                rules=tuple(miss_rule(i, j) for j in range(RULES_PER_POLICY)),
            )
        )
    selected = []
    for i in range(SELECTOR_POLICIES):
        p = Authorization(
            name=f"selector-{i}",
            namespace=TARGET_NAMESPACE,
            scope=Scope.WORKLOAD_SELECTOR,
            action=Action.DENY if i % 2 else Action.ALLOW,
            rules=tuple(miss_rule(i + count, j) for j in range(RULES_PER_POLICY)),
        )
        policies.append(p)
        selected.append(p.key)
    if matching_allow:
        # Last in namespace order and in the workload's own list: every DENY and ALLOW is tried first.
        p = Authorization(
            name="the-allow",
            namespace=TARGET_NAMESPACE,
            scope=Scope.WORKLOAD_SELECTOR,
            rules=tuple(miss_rule(count, j) for j in range(RULES_PER_POLICY - 1)) + (HIT_RULE,),
        )
        policies.append(p)
        selected.append(p.key)
    return policies, Target(namespace=TARGET_NAMESPACE, authorization_policies=tuple(selected))


def measure(fn: Callable[[], Decision], *, seconds: float, iterations: int) -> tuple[int, float, Decision]:
    decision = fn()  # warm up, and the decision the table reports
    n = 0
    start = time.perf_counter()
    deadline = start + seconds
    while n < iterations:
        fn()
        n += 1
        if time.perf_counter() > deadline:
            break
    return n, time.perf_counter() - start, decision


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--policies", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=1.0, help="time bound per case")
    parser.add_argument("--iterations", type=int, default=100_000, help="count bound per case")
    args = parser.parse_args()

    console = Console(width=120)
    table = Table(title=f"L4 authorization: {args.policies:,} policies x {RULES_PER_POLICY} rules")
    for col in ("case", "outcome", "path", "applicable", "decisions/s", "µs/decision", "n"):
        table.add_column(
            col, justify="right" if col in ("applicable", "decisions/s", "µs/decision", "n") else "left"
        )
    rows = []
    builds = []
    for case, scope in (("few", Scope.NAMESPACE), ("global", Scope.GLOBAL)):
        for outcome in ("allow", "deny"):
            policies, wl = build_policies(args.policies, scope=scope, matching_allow=outcome == "allow")
            t0 = time.perf_counter()
            index = PolicyIndex(policies)
            build_s = time.perf_counter() - t0
            builds.append(
                {"case": case, "outcome": outcome, "policies": len(index), "index_build_s": build_s}
            )
            by_key = {p.key: p for p in policies}
            applicable = len(index.applicable(wl))
            paths: list[tuple[str, Callable[[], Decision]]] = [
                ("index.check", lambda index=index, wl=wl: index.check(wl, CONN)),
                ("evaluate(compiled)", lambda index=index, wl=wl: evaluate(index.applicable(wl), CONN)),
                ("evaluate(dict)", lambda by_key=by_key, wl=wl: evaluate(policies_for(by_key, wl), CONN)),
            ]
            for path, fn in paths:
                n, elapsed, decision = measure(fn, seconds=args.seconds, iterations=args.iterations)
                assert decision.allowed is (outcome == "allow"), (case, outcome, decision)
                per = elapsed / n
                row = {
                    "case": case,
                    "outcome": outcome,
                    "path": path,
                    "applicable_policies": applicable,
                    "decisions_per_s": 1 / per,
                    "us_per_decision": per * 1e6,
                    "iterations": n,
                    "seconds": elapsed,
                    "reason": decision.reason,
                }
                rows.append(row)
                table.add_row(
                    case,
                    outcome,
                    path,
                    f"{applicable:,}",
                    f"{1 / per:,.0f}",
                    f"{per * 1e6:,.1f}",
                    f"{n:,}",
                )
    console.print(table)
    for b in builds:
        console.print(
            f"index build ({b['case']}, {b['outcome']}): {b['policies']:,} policies in {b['index_build_s']:.2f} s"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "rbac",
                "policies": args.policies,
                "rules_per_policy": RULES_PER_POLICY,
                "namespaces": NAMESPACES,
                "bounds": {"seconds": args.seconds, "iterations": args.iterations},
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "results": rows,
                "index_builds": builds,
            },
            indent=2,
        )
        + "\n"
    )
    console.print(
        f"wrote {RESULTS.relative_to(Path.cwd()) if RESULTS.is_relative_to(Path.cwd()) else RESULTS}"
    )


if __name__ == "__main__":
    main()
