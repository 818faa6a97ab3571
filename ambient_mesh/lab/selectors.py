"""Label selectors for `ambient lab get -l`: parse once, then match objects' labels.

Counterpart: the selector syntax of `kubectl get -l` (k8s.io/apimachinery labels.Parse), the
subset a user types: `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, `k` (exists) and
`!k` (does not exist), joined by commas; every requirement must hold. The parser is pure: it
returns a `Selector` or raises ConfigError naming the part it could not read.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError

MAX_SELECTOR_CHARS = 4096
MAX_REQUIREMENTS = 64
# A label key: an optional DNS-subdomain prefix and '/', then a name of up to 63 characters.
_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_SET = re.compile(r"^\s*(\S+)\s+(in|notin)\s+\(([^()]*)\)\s*$")


class Operator(enum.Enum):
    EQUALS = "="
    NOT_EQUALS = "!="
    IN = "in"
    NOT_IN = "notin"
    EXISTS = "exists"
    DOES_NOT_EXIST = "!"


@dataclass(frozen=True, slots=True, kw_only=True)
class Requirement:
    key: str
    operator: Operator
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        match self.operator:
            case Operator.EQUALS | Operator.IN:
                return present and value in self.values
            case Operator.NOT_EQUALS | Operator.NOT_IN:
                # kubectl's rule: a missing label satisfies `!=` and `notin`.
                return not present or value not in self.values
            case Operator.EXISTS:
                return present
            case Operator.DOES_NOT_EXIST:
                return not present


@dataclass(frozen=True, slots=True, kw_only=True)
class Selector:
    requirements: tuple[Requirement, ...]

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)


def _split(text: str) -> list[str]:
    """Split on the commas outside parentheses."""
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise ConfigError("-l", f"{text!r}: a ')' without its '('")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth:
        raise ConfigError("-l", f"{text!r}: a '(' without its ')'")
    parts.append("".join(current))
    return parts


def _key(text: str, part: str) -> str:
    key = text.strip()
    if not _KEY.match(key):
        raise ConfigError("-l", f"{part.strip()!r}: {key!r} is not a label key")
    return key


def _value(text: str, part: str) -> str:
    value = text.strip()
    if not _VALUE.match(value):
        raise ConfigError("-l", f"{part.strip()!r}: {value!r} is not a label value")
    return value


def _requirement(part: str) -> Requirement:
    if not part.strip():
        raise ConfigError("-l", "an empty requirement (two commas, or one at an end)")
    m = _SET.match(part)
    if m:
        values = frozenset(_value(v, part) for v in m.group(3).split(","))
        op = Operator.IN if m.group(2) == "in" else Operator.NOT_IN
        return Requirement(key=_key(m.group(1), part), operator=op, values=values)
    for token, op in (("!=", Operator.NOT_EQUALS), ("==", Operator.EQUALS), ("=", Operator.EQUALS)):
        if token in part:
            key, _, value = part.partition(token)
            return Requirement(key=_key(key, part), operator=op, values=frozenset({_value(value, part)}))
    stripped = part.strip()
    if stripped.startswith("!"):
        return Requirement(key=_key(stripped[1:], part), operator=Operator.DOES_NOT_EXIST)
    return Requirement(key=_key(stripped, part), operator=Operator.EXISTS)


def parse_selector(text: str) -> Selector:
    """`kubectl get -l` text as a Selector; raises ConfigError naming what it could not read."""
    if len(text) > MAX_SELECTOR_CHARS:
        raise ConfigError("-l", f"the selector is {len(text)} characters; at most {MAX_SELECTOR_CHARS}")
    parts = _split(text)
    if len(parts) > MAX_REQUIREMENTS:
        raise ConfigError("-l", f"{len(parts)} requirements; at most {MAX_REQUIREMENTS}")
    return Selector(requirements=tuple(_requirement(p) for p in parts))


__all__ = ["Operator", "Requirement", "Selector", "parse_selector"]
