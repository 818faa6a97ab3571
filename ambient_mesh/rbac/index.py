"""Which policies apply to a workload, and the index that finds them: ztunnel's PolicyStore.

Counterparts: ztunnel src/state/policy.rs (`PolicyStore`, the by-namespace index) and the
selection in `assert_rbac` (src/state.rs): the destination namespace's policies, the global ones,
then the workload's own list (docs/istio-behaviour.md, "Authorization").
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Protocol

from .compiled import CompiledPolicy, _decide
from .keys import Key, KeyLength, RuleFilter, conn_keys, rule_filters
from .model import REASON_NO_ALLOW_POLICIES, Authorization, Decision, RbacConnection, Scope

log = logging.getLogger(__name__)

# -- which policies apply (docs/istio-behaviour.md, "Authorization") -------------------------------


class PolicyTarget(Protocol):
    """What policy selection reads of a destination workload (`state.model.Workload` fits)."""

    @property
    def namespace(self) -> str: ...

    @property
    def authorization_policies(self) -> Sequence[str]: ...


GLOBAL_INDEX = ""


def _index_namespace(policy: Authorization) -> str | None:
    """Where ztunnel's PolicyStore files a policy: GLOBAL under "" whatever its own namespace
    (istiod gives root-namespace policies without selector GLOBAL scope, and they must reach
    every namespace), NAMESPACE under its namespace, WORKLOAD_SELECTOR nowhere."""
    match policy.scope:
        case Scope.GLOBAL:
            return GLOBAL_INDEX
        case Scope.NAMESPACE:
            return policy.namespace
        case Scope.WORKLOAD_SELECTOR:
            return None
    raise AssertionError(policy.scope)


# A workload naming a policy the state does not have is a transition (the workload arrived before
# its policy, or the policy was removed first) that lasts until the next push; every check meets
# it. Counted on every check, logged once per policy name (at most MAX_UNKNOWN_POLICIES_LOGGED
# names remembered; past that the memory starts again).
MAX_UNKNOWN_POLICIES_LOGGED = 1024


class UnknownPolicies:
    """How often a check skipped a policy name the state does not have, logged once a name."""

    def __init__(self) -> None:
        self.skipped = 0
        self._logged: set[str] = set()

    def note(self, key: str) -> None:
        self.skipped += 1
        if key in self._logged:
            return
        if len(self._logged) >= MAX_UNKNOWN_POLICIES_LOGGED:
            self._logged.clear()
        self._logged.add(key)
        log.warning("skipping unknown policy %s (a workload names it; logged once, counted after)", key)

    def forget(self) -> None:
        """Log each name again from now on (the count stays)."""
        self._logged.clear()

    def __repr__(self) -> str:
        return f"UnknownPolicies({self.skipped} skipped, {len(self._logged)} names logged)"


unknown_policies = UnknownPolicies()


def _selected(
    lookup: Callable[[str], Authorization | None], workload: PolicyTarget
) -> Iterator[tuple[str, Authorization]]:
    """The workload's own policy list, minus unknown keys (warned) and keys the namespace and
    global indexes already contributed (ztunnel would evaluate those twice; the result is the
    same, the dry-run log would not be)."""
    seen: set[str] = set()
    for key in workload.authorization_policies:
        policy = lookup(key)
        if policy is None:
            unknown_policies.note(key)
            continue
        if key in seen or _index_namespace(policy) in (workload.namespace, GLOBAL_INDEX):
            continue
        seen.add(key)
        yield key, policy


def policies_for(state_policies: Mapping[str, Authorization], workload: PolicyTarget) -> list[Authorization]:
    """The policies that apply to `workload`: its namespace's, the global ones, its own list.

    With a PolicyIndex this uses the index; with a plain mapping it scans every policy (fine for
    tests and small local configs, not for the per-connection path of a large mesh).
    """
    if isinstance(state_policies, PolicyIndex):
        return [c.policy for c in state_policies.applicable(workload)]
    ns = workload.namespace
    values = state_policies.values()
    result = [p for p in values if _index_namespace(p) == ns] if ns != GLOBAL_INDEX else []
    result.extend(p for p in values if _index_namespace(p) == GLOBAL_INDEX)
    result.extend(p for _key, p in _selected(state_policies.get, workload))
    return result


# `_decide` of empty lists: nothing denies, no ALLOW exists, so allowed (a frozen value, shared).
_NOTHING_APPLIES = Decision(allowed=True, policy=None, reason=REASON_NO_ALLOW_POLICIES, dry_run_matches=())

# Below this many policies a bucket is matched in full: computing the connection's keys and
# looking them up costs about as much as matching a few policies (bench/rbac_bench.py).
MIN_INDEXED_POLICIES = 16


class PolicyBucket:
    """The policies filed under one namespace ("" = GLOBAL) in arrival order, with the postings
    that prune them: guard key -> exclusion -> sequence numbers of the policies filed there."""

    __slots__ = ("policies", "postings", "filed", "enforced_allow")

    def __init__(self) -> None:
        self.policies: dict[int, CompiledPolicy] = {}
        self.postings: dict[Key, dict[frozenset[Key], set[int]]] = {}
        self.filed: dict[int, tuple[tuple[Key, frozenset[Key]], ...]] = {}
        # Pruning may drop every ALLOW, but "no allow policies" is about existence, not matching.
        self.enforced_allow = 0

    def add(self, seq: int, compiled: CompiledPolicy, filters: Sequence[RuleFilter]) -> None:
        self.policies[seq] = compiled
        entries = {(key, f.exclusion) for f in filters for key in f.guard}
        for key, exclusion in entries:
            self.postings.setdefault(key, {}).setdefault(exclusion, set()).add(seq)
        self.filed[seq] = tuple(entries)
        if not compiled.deny and not compiled.dry_run:
            self.enforced_allow += 1

    def discard(self, seq: int) -> None:
        compiled = self.policies.pop(seq)
        for key, exclusion in self.filed.pop(seq):
            groups = self.postings[key]
            seqs = groups[exclusion]
            seqs.discard(seq)
            if not seqs:
                del groups[exclusion]
                if not groups:
                    del self.postings[key]
        if not compiled.deny and not compiled.dry_run:
            self.enforced_allow -= 1

    def candidates(self, keys: frozenset[Key]) -> list[CompiledPolicy]:
        """The policies, in order, that are not provably unable to match a connection with `keys`."""
        found: set[int] = set()
        postings = self.postings
        for key in keys:
            groups = postings.get(key)
            if groups:
                for exclusion, seqs in groups.items():
                    if exclusion.isdisjoint(keys):
                        found.update(seqs)
        policies = self.policies
        return [policies[seq] for seq in sorted(found)]

    def __len__(self) -> int:
        return len(self.policies)

    def __repr__(self) -> str:
        return (
            f"<PolicyBucket: {len(self.policies)} policies, {self.enforced_allow} enforced ALLOW, "
            f"{len(self.postings)} guard keys>"
        )


class PolicyIndex(MutableMapping[str, Authorization]):
    """All policies by key, compiled, plus ztunnel's by-namespace index ("" = GLOBAL).

    A drop-in for the `dict[str, Authorization]` that ProxyState keeps (`index[key] = policy`,
    `pop`, `clear`, `items` all work), so a per-connection lookup touches only the destination
    namespace's and the global policies, and each policy is compiled once, when it arrives.
    Buckets of at least `min_indexed` policies are pruned by key (PolicyBucket) before matching.
    """

    def __init__(
        self, policies: Iterable[Authorization] = (), *, min_indexed: int = MIN_INDEXED_POLICIES
    ) -> None:
        self.min_indexed = min_indexed
        self._by_key: dict[str, CompiledPolicy] = {}
        self._seq: dict[str, int] = {}
        self._next_seq = itertools.count()
        self._by_namespace: dict[str, PolicyBucket] = {}
        # Key lengths in use by filed policies, counted so that removals can retire them.
        self._lengths: Counter[KeyLength] = Counter()
        self._filed_lengths: dict[str, frozenset[KeyLength]] = {}
        self._grouped: dict[tuple[int, int], tuple[int, ...]] | None = None
        for policy in policies:
            self.insert(policy)

    # -- writes -----------------------------------------------------------------------------------

    def insert(self, policy: Authorization) -> None:
        """Add or replace a policy; a replacement may change scope, so the old entry is unfiled."""
        self._unfile(policy.key)
        compiled = CompiledPolicy(policy)
        key = compiled.key
        self._by_key[key] = compiled
        index = _index_namespace(policy)
        if index is None:
            return
        seq = next(self._next_seq)
        self._seq[key] = seq
        filters, lengths = rule_filters(policy)
        bucket = self._by_namespace.get(index)
        if bucket is None:
            bucket = self._by_namespace[index] = PolicyBucket()
        bucket.add(seq, compiled, filters)
        if lengths:
            self._filed_lengths[key] = lengths
            if any(length not in self._lengths for length in lengths):
                self._grouped = None
            self._lengths.update(lengths)

    def remove(self, key: str) -> bool:
        return self._unfile(key) is not None

    def _unfile(self, key: str) -> CompiledPolicy | None:
        old = self._by_key.pop(key, None)
        if old is None:
            return None
        index = _index_namespace(old.policy)
        if index is None:
            return old
        bucket = self._by_namespace[index]
        bucket.discard(self._seq.pop(key))
        if not bucket:
            del self._by_namespace[index]
        lengths = self._filed_lengths.pop(key, ())
        if lengths:
            self._lengths.subtract(lengths)
            for length in lengths:
                if self._lengths[length] <= 0:
                    del self._lengths[length]
                    self._grouped = None
        return old

    def clear(self) -> None:
        self._by_key.clear()
        self._seq.clear()
        self._by_namespace.clear()
        self._lengths.clear()
        self._filed_lengths.clear()
        self._grouped = None

    def __setitem__(self, key: str, policy: Authorization) -> None:
        if key != policy.key:
            raise KeyError(f"policy {policy.key} filed under {key!r}: the key must be namespace/name")
        self.insert(policy)

    def __delitem__(self, key: str) -> None:
        if not self.remove(key):
            raise KeyError(key)

    # -- reads ------------------------------------------------------------------------------------

    def __getitem__(self, key: str) -> Authorization:
        return self._by_key[key].policy

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_key)

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def compiled(self, key: str) -> CompiledPolicy | None:
        return self._by_key.get(key)

    def by_namespace(self, namespace: str) -> tuple[Authorization, ...]:
        """The policies filed under `namespace` (NAMESPACE scope; "" gives the GLOBAL ones)."""
        bucket = self._by_namespace.get(namespace)
        return tuple(c.policy for c in bucket.policies.values()) if bucket else ()

    def global_(self) -> tuple[Authorization, ...]:
        return self.by_namespace(GLOBAL_INDEX)

    def bucket(self, namespace: str) -> PolicyBucket | None:
        return self._by_namespace.get(namespace)

    def _own(self, workload: PolicyTarget) -> list[CompiledPolicy]:
        if not workload.authorization_policies:
            return []
        by_key = self._by_key

        def lookup(key: str) -> Authorization | None:
            compiled = by_key.get(key)
            return compiled.policy if compiled else None

        return [by_key[key] for key, _policy in _selected(lookup, workload)]

    def _buckets(self, workload: PolicyTarget) -> list[PolicyBucket]:
        ns = workload.namespace
        buckets = []
        if ns != GLOBAL_INDEX and (bucket := self._by_namespace.get(ns)):
            buckets.append(bucket)
        if bucket := self._by_namespace.get(GLOBAL_INDEX):
            buckets.append(bucket)
        return buckets

    def applicable(self, workload: PolicyTarget) -> list[CompiledPolicy]:
        """What `policies_for` returns, compiled: namespace, then global, then the workload's list."""
        result: list[CompiledPolicy] = []
        for bucket in self._buckets(workload):
            result.extend(bucket.policies.values())
        result.extend(self._own(workload))
        return result

    def conn_keys(self, conn: RbacConnection) -> frozenset[Key]:
        """The connection's key set, covering every key length a filed policy uses."""
        grouped = self._grouped
        if grouped is None:
            by_field: dict[tuple[int, int], list[int]] = {}
            for tag, version, length in sorted(self._lengths):
                by_field.setdefault((tag, version), []).append(length)
            grouped = self._grouped = {field: tuple(lengths) for field, lengths in by_field.items()}
        return conn_keys(conn, grouped)

    def candidates(self, workload: PolicyTarget, conn: RbacConnection) -> tuple[list[CompiledPolicy], bool]:
        """The applicable policies that may match `conn`, in `applicable` order, and whether any
        enforced ALLOW applies at all (pruned or not)."""
        result: list[CompiledPolicy] = []
        any_allow = False
        keys: frozenset[Key] | None = None
        for bucket in self._buckets(workload):
            any_allow = any_allow or bucket.enforced_allow > 0
            if len(bucket) < self.min_indexed:
                result.extend(bucket.policies.values())
                continue
            if keys is None:
                keys = self.conn_keys(conn)
            result.extend(bucket.candidates(keys))
        result.extend(self._own(workload))
        return result, any_allow

    def check(self, workload: PolicyTarget, conn: RbacConnection) -> Decision:
        """`evaluate(policies_for(self, workload), conn)`, matching only the candidates.

        Dropping a policy that cannot match changes no decision: the first matching DENY or
        ALLOW, and the dry-run matches, are the same in the full list and in the candidates;
        only "are there any enforced ALLOWs" needs the full set, and the buckets count those.
        """
        by_namespace = self._by_namespace
        if (
            not workload.authorization_policies
            and GLOBAL_INDEX not in by_namespace
            and workload.namespace not in by_namespace
        ):
            # No policy applies (Istio's default: allowed): what `_decide` returns for empty
            # lists, without the connection's values (the common case of a mesh without policies
            # for this namespace, every inbound connection).
            return _NOTHING_APPLIES
        policies, any_allow = self.candidates(workload, conn)
        deny: list[CompiledPolicy] = []
        allow: list[CompiledPolicy] = []
        dry_deny: list[CompiledPolicy] = []
        dry_allow: list[CompiledPolicy] = []
        for compiled in policies:
            if compiled.dry_run:
                (dry_deny if compiled.deny else dry_allow).append(compiled)
            else:
                (deny if compiled.deny else allow).append(compiled)
        return _decide(deny, allow, dry_deny, dry_allow, conn, any_allow=any_allow)

    def __repr__(self) -> str:
        glob = self._by_namespace.get(GLOBAL_INDEX)
        n_global = len(glob) if glob else 0
        namespaces = len(self._by_namespace) - (1 if glob else 0)
        indexed = sum(len(b) for b in self._by_namespace.values())
        return (
            f"<PolicyIndex: {len(self._by_key)} policies, {n_global} global, "
            f"{indexed - n_global} in {namespaces} namespaces, {len(self._by_key) - indexed} by selector>"
        )
