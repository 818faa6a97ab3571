"""Necessary conditions for L4 authorization policies: the keys that prune a PolicyIndex.

Counterpart: none in ztunnel (its PolicyStore files policies by namespace only and matches each
one); this is what lets a check with thousands of GLOBAL policies touch a handful
(bench/rbac_bench.py). Pruning only filters: the survivors are matched by `compiled`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from .model import Authorization, IPNetwork, Match, RbacConnection, StringMatch, StringMatchKind

# -- necessary conditions: which policies can possibly match (the pruning index) --------------------
#
# Every entry of a Match list (one StringMatch, CIDR, port or service account) holds for a
# connection exactly when its *key* is in the connection's key set (`conn_keys`): a prefix "abc"
# holds when the value cut to 3 characters is "abc", a /24 when the address shifted right by 8
# bits equals the network's, and so on. Keys are tuples tagged by field, so fields never collide.
# The connection's set has one key per field, plus one per prefix, suffix and CIDR length that
# some indexed policy uses (`KeyLength`).
#
# From entry keys each rule gets a filter: a guard (the rule can only hold if the connection has
# one of its keys; ALWAYS_KEY when nothing is required) and an exclusion (the rule cannot hold if
# the connection has any of its keys). A bucket files a policy under its rules' guard keys, grouped
# by exclusion, so a check looks up the connection's few keys and never touches a policy that
# provably cannot match. Pruning only filters: the survivors are matched as before.

(
    _K_PRINCIPAL,
    _K_PRINCIPAL_PREFIX,
    _K_PRINCIPAL_SUFFIX,
    _K_PRINCIPAL_PRESENT,
    _K_NAMESPACE,
    _K_NAMESPACE_PREFIX,
    _K_NAMESPACE_SUFFIX,
    _K_NAMESPACE_PRESENT,
    _K_ACCOUNT,
    _K_SRC_IP,
    _K_DST_IP,
    _K_PORT,
    _K_ALWAYS,
) = range(13)

# A key: a field tag, then the values that identify one entry (strings, integers).
Key = tuple[object, ...]
ALWAYS_KEY: Key = (_K_ALWAYS,)
# A length the connection's key set must cover: (tag, IP version or 0, length).
KeyLength = tuple[int, int, int]
_NO_KEYS: frozenset[Key] = frozenset()
_ALWAYS: frozenset[Key] = frozenset((ALWAYS_KEY,))

# Tags for EXACT, PREFIX, SUFFIX, PRESENCE, by field (True: principals, False: namespaces).
_STRING_TAGS = {
    True: (_K_PRINCIPAL, _K_PRINCIPAL_PREFIX, _K_PRINCIPAL_SUFFIX, _K_PRINCIPAL_PRESENT),
    False: (_K_NAMESPACE, _K_NAMESPACE_PREFIX, _K_NAMESPACE_SUFFIX, _K_NAMESPACE_PRESENT),
}

# Which positive list guards a rule: the rank of a list is its worst entry's, and lower ranks are
# rarer among connections. Identities are the most selective; ports (a mesh has few) and entries
# that hold for nearly everyone (presence, "" affixes, /0) the least. Any choice is correct.
_RANK_IDENTITY, _RANK_SRC_IP, _RANK_NAMESPACE, _RANK_DST_IP, _RANK_AFFIX, _RANK_PORT, _RANK_ANY = range(7)


def _string_keys(
    matches: Sequence[StringMatch], principal: bool, lengths: set[KeyLength]
) -> tuple[int, list[Key]]:
    exact_tag, prefix_tag, suffix_tag, present_tag = _STRING_TAGS[principal]
    rank = 0
    keys: list[Key] = []
    for m in matches:
        kind = m.kind
        if kind is StringMatchKind.EXACT:
            keys.append((exact_tag, m.value))
            rank = max(rank, _RANK_IDENTITY if principal else _RANK_NAMESPACE)
        elif kind is StringMatchKind.PRESENCE:
            keys.append((present_tag,))
            rank = _RANK_ANY
        else:
            tag = prefix_tag if kind is StringMatchKind.PREFIX else suffix_tag
            keys.append((tag, m.value))
            lengths.add((tag, 0, len(m.value)))
            rank = max(rank, _RANK_AFFIX if m.value else _RANK_ANY)
    return rank, keys


def _ip_keys(tag: int, networks: Sequence[IPNetwork], lengths: set[KeyLength]) -> tuple[int, list[Key]]:
    rank = _RANK_SRC_IP if tag == _K_SRC_IP else _RANK_DST_IP
    keys: list[Key] = []
    for net in networks:
        length = net.prefixlen
        keys.append((tag, net.version, length, int(net.network_address) >> (net.max_prefixlen - length)))
        lengths.add((tag, net.version, length))
        if length == 0:
            rank = _RANK_ANY
    return rank, keys


def _better(best: tuple[int, list[Key]] | None, candidate: tuple[int, list[Key]]) -> tuple[int, list[Key]]:
    return candidate if best is None or candidate[0] < best[0] else best


def _match_keys(m: Match, lengths: set[KeyLength]) -> tuple[tuple[int, list[Key]] | None, set[Key]]:
    """One Match in keys: its best-ranked positive list (None when it has none) and the union of
    its negative lists (any one of those keys in the connection's set makes the Match fail).
    Positive lists are looked at from the best possible rank down, skipping those that cannot
    rank better; a list never looked at adds no key lengths (none of its keys are filed)."""
    best: tuple[int, list[Key]] | None = None
    if m.service_accounts:
        best = (_RANK_IDENTITY, [(_K_ACCOUNT, a.namespace, a.service_account) for a in m.service_accounts])
    if m.principals and best is None:
        best = _string_keys(m.principals, True, lengths)
    # Unrolled on purpose: per-call closures would cost more in GC work than the lookups save.
    if m.source_ips and (best is None or best[0] > _RANK_SRC_IP):
        best = _better(best, _ip_keys(_K_SRC_IP, m.source_ips, lengths))
    if m.namespaces and (best is None or best[0] > _RANK_NAMESPACE):
        best = _better(best, _string_keys(m.namespaces, False, lengths))
    if m.destination_ips and (best is None or best[0] > _RANK_DST_IP):
        best = _better(best, _ip_keys(_K_DST_IP, m.destination_ips, lengths))
    if m.destination_ports and (best is None or best[0] > _RANK_PORT):
        best = (_RANK_PORT, [(_K_PORT, p) for p in m.destination_ports])
    negative: set[Key] = set()
    if m.not_service_accounts:
        negative.update((_K_ACCOUNT, a.namespace, a.service_account) for a in m.not_service_accounts)
    if m.not_principals:
        negative.update(_string_keys(m.not_principals, True, lengths)[1])
    if m.not_namespaces:
        negative.update(_string_keys(m.not_namespaces, False, lengths)[1])
    if m.not_source_ips:
        negative.update(_ip_keys(_K_SRC_IP, m.not_source_ips, lengths)[1])
    if m.not_destination_ips:
        negative.update(_ip_keys(_K_DST_IP, m.not_destination_ips, lengths)[1])
    if m.not_destination_ports:
        negative.update((_K_PORT, p) for p in m.not_destination_ports)
    return best, negative


@dataclass(frozen=True, slots=True, kw_only=True)
class RuleFilter:
    """A necessary condition for one rule: it can hold only if the connection's key set meets
    `guard` and misses `exclusion` (ALWAYS_KEY is in every connection's set)."""

    guard: frozenset[Key]
    exclusion: frozenset[Key] = _NO_KEYS

    def admits(self, keys: Set[Key]) -> bool:
        return not self.guard.isdisjoint(keys) and self.exclusion.isdisjoint(keys)


def rule_filters(policy: Authorization) -> tuple[tuple[RuleFilter, ...], frozenset[KeyLength]]:
    """The filter of every rule that can hold at all (a rule with a clause made only of empty
    Matches never does), and the key lengths the filters rely on."""
    lengths: set[KeyLength] = set()
    filters: list[RuleFilter] = []
    for rule in policy.rules:
        best: tuple[int, set[Key]] | None = None
        exclusion: set[Key] = set()
        possible = True
        for clause in rule.clauses:
            if not clause.matches:
                continue  # holds for everyone: neither guards nor excludes
            clause_rank = 0
            clause_guard: set[Key] | None = set()
            clause_exclusion: set[Key] | None = None
            for m in clause.matches:
                guard, negative = _match_keys(m, lengths)
                if guard is None and not negative:
                    continue  # an empty Match: skipped, never "matches everything"
                if guard is None:
                    clause_guard = None
                elif clause_guard is not None:
                    clause_rank = max(clause_rank, guard[0])
                    clause_guard.update(guard[1])
                # The clause fails only if every Match fails: keys that exclude all of them.
                clause_exclusion = negative if clause_exclusion is None else clause_exclusion & negative
            if clause_exclusion is None:
                possible = False  # only empty Matches: the clause, and so the rule, never holds
                break
            exclusion |= clause_exclusion
            if clause_guard is not None and (best is None or clause_rank < best[0]):
                best = (clause_rank, clause_guard)
        if possible:
            rule_guard = frozenset(best[1]) if best is not None else _ALWAYS
            filters.append(RuleFilter(guard=rule_guard, exclusion=frozenset(exclusion)))
    return tuple(filters), frozenset(lengths)


def conn_keys(conn: RbacConnection, lengths: Mapping[tuple[int, int], Sequence[int]]) -> frozenset[Key]:
    """The connection's key set; `lengths` maps (tag, IP version or 0) to the lengths in use."""
    keys: list[Key] = [ALWAYS_KEY, (_K_PORT, conn.dst_port)]
    identity = conn.src_identity
    # Without identity the namespace is "" (so exact "" and empty affixes hold) and no principal
    # or service account key exists: no principal entry of any kind holds (see `compiled._Source.strings`).
    namespace = identity.namespace if identity is not None else ""
    strings: list[tuple[str, tuple[int, int, int, int]]] = [(namespace, _STRING_TAGS[False])]
    if identity is not None:
        keys.append((_K_ACCOUNT, identity.namespace, identity.service_account))
        strings.append((identity.principal, _STRING_TAGS[True]))
    for value, (exact_tag, prefix_tag, suffix_tag, present_tag) in strings:
        keys.append((exact_tag, value))
        if value:
            keys.append((present_tag,))
        size = len(value)
        keys.extend((prefix_tag, value[:n]) for n in lengths.get((prefix_tag, 0), ()) if n <= size)
        keys.extend((suffix_tag, value[size - n :]) for n in lengths.get((suffix_tag, 0), ()) if n <= size)
    for tag, ip in ((_K_SRC_IP, conn.src_ip), (_K_DST_IP, conn.dst_ip)):
        version, bits, number = ip.version, ip.max_prefixlen, int(ip)
        keys.extend((tag, version, n, number >> (bits - n)) for n in lengths.get((tag, version), ()))
    return frozenset(keys)
