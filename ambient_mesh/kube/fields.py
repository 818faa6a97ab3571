"""Typed, path-tracking reads of a decoded YAML or JSON document, and the parts every kind shares.

`Fields` wraps one mapping of a decoded document: each read checks the value's type and bounds and
raises `FieldError` naming the field path (`spec.ports[0].port: expected an integer`), and `only`
refuses a field the schema does not have, as the API server's strict field validation does. The
readers here serve every kind: object metadata, label selectors, the top level of a custom
resource and durations.
"""

from __future__ import annotations

import re
from typing import Any, TypeAlias

from .labels import LabelSelector  # only matchLabels is parsed: these kinds have no expressions
from .model import ObjectMeta, OwnerReference


class FieldError(Exception):
    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


MISSING = object()
# Fields has methods named str, int and bool: in its body those names are the methods
_Str: TypeAlias = str
_Int: TypeAlias = int
_Bool: TypeAlias = bool


# Where a Fields is in its document: the path itself, or (parent, key, list index or None), made
# into text only for an error (a 10,000-pod file has about 100,000 mappings and lists).
_At: TypeAlias = "str | tuple[Fields, str, int | None]"


def _where(at: _At) -> str:
    if isinstance(at, str):
        return at
    parent, key, index = at
    path = parent.child(key)
    return path if index is None else f"{path}[{index}]"


class Fields:
    """Typed access to one mapping of a decoded YAML document, tracking the field path."""

    __slots__ = ("data", "_at")

    def __init__(self, data: Any, at: _At) -> None:
        if not isinstance(data, dict):
            raise FieldError(_where(at) or "<document>", "expected a mapping")
        self.data = data
        self._at = at

    @property
    def path(self) -> str:
        """Where this mapping is in its document (`spec.ports[0]`); empty at the top."""
        return _where(self._at)

    def child(self, key: str) -> str:
        path = self.path
        return f"{path}.{key}" if path else key

    def value(self, key: str) -> Any:
        """The raw value under `key`, or `MISSING` when it is absent or null."""
        value = self.data.get(key, MISSING)
        return MISSING if value is None else value

    def has(self, key: str) -> bool:
        return self.value(key) is not MISSING

    def str(self, key: str, default: str = "") -> str:
        value = self.data.get(key)  # value() inlined: this is most of the per-field cost
        if value is None:
            return default
        if not isinstance(value, str):
            raise FieldError(self.child(key), "expected a string")
        return value

    def int(self, key: _Str, default: _Int = 0, *, lo: _Int = 0, hi: _Int = 2**31 - 1) -> _Int:
        value = self.value(key)
        if value is MISSING:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise FieldError(self.child(key), "expected an integer")
        if not lo <= value <= hi:
            raise FieldError(self.child(key), f"{value} out of range {lo}-{hi}")
        return value

    def bool(self, key: _Str, default: _Bool = False) -> _Bool:
        value = self.value(key)
        if value is MISSING:
            return default
        if not isinstance(value, bool):
            raise FieldError(self.child(key), "expected true or false")
        return value

    def enum(self, key: _Str, allowed: tuple[_Str, ...], default: _Str) -> _Str:
        value = self.str(key, default)
        if value not in allowed:
            raise FieldError(self.child(key), f"{value!r} is not one of {', '.join(allowed)}")
        return value

    def sub(self, key: _Str) -> Fields | None:
        value = self.data.get(key)
        if value is None:
            return None
        return Fields(value, (self, key, None))

    def items(self, key: _Str) -> list[Fields]:
        value = self.data.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise FieldError(self.child(key), "expected a list")
        return [Fields(v, (self, key, i)) for i, v in enumerate(value)]

    def strings(self, key: _Str) -> tuple[_Str, ...]:
        value = self.value(key)
        if value is MISSING:
            return ()
        if not isinstance(value, list):
            raise FieldError(self.child(key), "expected a list of strings")
        for i, v in enumerate(value):
            if not isinstance(v, str):
                raise FieldError(f"{self.child(key)}[{i}]", "expected a string")
        return tuple(value)

    def string_map(self, key: _Str) -> dict[_Str, _Str]:
        value = self.value(key)
        if value is MISSING:
            return {}
        if not isinstance(value, dict):
            raise FieldError(self.child(key), "expected a mapping of strings")
        for k, v in value.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise FieldError(f"{self.child(key)}.{k}", "expected a string")
        return dict(value)

    def only(self, *allowed: _Str) -> Fields:
        """Refuse a field the CRD's schema does not have, as the API server's strict field
        validation does: a typo (`principal:`) must not silently widen or void a policy."""
        for key in self.data:
            if key not in allowed:
                raise FieldError(
                    self.child(str(key)), f"unknown field (expected one of {', '.join(sorted(allowed))})"
                )
        return self

    def port_map(self, key: _Str) -> dict[_Str, _Int]:
        value = self.value(key)
        if value is MISSING:
            return {}
        if not isinstance(value, dict):
            raise FieldError(self.child(key), "expected a mapping of port numbers")
        out: dict[str, int] = {}
        for k, v in value.items():
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 65535:
                raise FieldError(f"{self.child(key)}.{k}", "expected a port number 0-65535")
            out[str(k)] = v
        return out


# -- what every kind shares ------------------------------------------------------------------------


def object_meta(doc: Fields, *, namespaced: bool) -> ObjectMeta:
    m = doc.sub("metadata")
    if m is None:
        raise FieldError("metadata", "missing")
    name = m.str("name")
    if not name:
        raise FieldError("metadata.name", "missing")
    owners = tuple(
        OwnerReference(
            api_version=o.str("apiVersion"),
            kind=o.str("kind"),
            name=o.str("name"),
            controller=o.bool("controller"),
        )
        for o in m.items("ownerReferences")
    )
    return ObjectMeta(
        name=name,
        # Like kubectl apply, a namespaced object without a namespace lands in `default`.
        namespace=(m.str("namespace") or "default") if namespaced else "",
        uid=m.str("uid"),
        labels=m.string_map("labels"),
        annotations=m.string_map("annotations"),
        creation_timestamp=_timestamp(m, "creationTimestamp"),
        deletion_timestamp=_timestamp(m, "deletionTimestamp"),
        generate_name=m.str("generateName"),
        owner_references=owners,
    )


def _timestamp(m: Fields, key: str) -> str:
    # PyYAML turns an unquoted RFC 3339 value into a datetime; keep the text form.
    raw = m.value(key)
    if raw is MISSING:
        return ""
    if hasattr(raw, "isoformat"):
        return str(raw.isoformat()).replace("+00:00", "Z")
    return m.str(key)


def label_selector(f: Fields | None, key: str = "matchLabels") -> LabelSelector | None:
    if f is None:
        return None
    return LabelSelector(match_labels=f.string_map(key))


# The top level of a custom resource (Istio's CRDs, Gateway API's HTTPRoute).
CRD_TOP_FIELDS = ("apiVersion", "kind", "metadata", "spec", "status")


def crd_spec(doc: Fields, *spec_fields: str) -> Fields:
    """The spec of an Istio custom resource, with unknown fields refused at both levels."""
    doc.only(*CRD_TOP_FIELDS)
    return (doc.sub("spec") or Fields({}, "spec")).only(*spec_fields)


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s)")
_DURATION_MS = {"h": 3_600_000, "m": 60_000, "s": 1000, "ms": 1}


def duration_ms(f: Fields, key: str) -> int | None:
    """A duration as Gateway API (`1h30m`, `500ms`) or Istio (`1.5s`) writes it, in milliseconds."""
    text = f.str(key)
    if not text:
        return None
    pos, total = 0, 0.0
    for m in _DURATION.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DURATION_MS[m.group(2)]
        pos = m.end()
    if pos != len(text) or pos == 0 or len(text) > 32:
        raise FieldError(f.child(key), f"{text!r} is not a duration (for example 10s, 500ms, 1m30s)")
    return int(total)
