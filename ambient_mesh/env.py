"""Environment variables -> typed values: the one reader behind every program's settings.

Counterparts: ztunnel src/config.rs (its parse helpers) for the node proxy, and istio-cni's
viper/cobra reads for the node agent. One grammar for each kind of value, so a duration or a
number means the same in every variable of every program; the one difference kept is how
booleans are spelled, because the originals differ (Rust's `bool::from_str` plus 1/0 in
ztunnel, Go's `strconv.ParseBool` plus yes/no/on/off in istio-cni) and users copy values from
their documentation. Every error is a ConfigError whose `source` is the variable's name and
whose message lists the accepted forms.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import ConfigError, ProtocolError
from .net import SocketAddr


@dataclass(frozen=True, slots=True, kw_only=True)
class BoolSpelling:
    true: frozenset[str]
    false: frozenset[str]
    forms: str  # for error messages


# ztunnel: Rust's "true"/"false", and 1/0 (its env helper).
ZTUNNEL_BOOLS = BoolSpelling(
    true=frozenset({"true", "1"}), false=frozenset({"false", "0"}), forms="true, false, 1 or 0"
)
# istio-cni: Go's strconv.ParseBool forms (case-insensitive here) and viper's yes/no/on/off.
ISTIO_CNI_BOOLS = BoolSpelling(
    true=frozenset({"1", "t", "true", "y", "yes", "on"}),
    false=frozenset({"0", "f", "false", "n", "no", "off"}),
    forms="true or false",
)

# -- durations: Go's time.ParseDuration grammar (what Istio's Go and ztunnel's users write) --------

_DURATION_UNITS_S = {
    "ns": 1e-9,
    "us": 1e-6,
    "\u00b5s": 1e-6,
    "\u03bcs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")
DURATION_FORMS = "a Go duration such as 24h, 90m, 10s, 1h30m or 500ms"


def parse_duration(text: str) -> float:
    """Parse a Go-style duration (`1h30m`, `10s`, `1.5h`, `0`) into seconds.

    Raises ValueError; negative durations are refused because nothing here can use one, and a
    bare number (other than 0) is refused because its unit would be a guess.
    """
    s = text.strip()
    if s == "0":
        return 0.0
    if not s:
        raise ValueError("empty duration")
    total = 0.0
    pos = 0
    while pos < len(s):
        m = _DURATION_PART.match(s, pos)
        if m is None:
            raise ValueError(f"{text!r} is not a duration")
        total += float(m.group(1)) * _DURATION_UNITS_S[m.group(2)]
        pos = m.end()
    return total


def format_duration(seconds: float) -> str:
    """The shortest Go-style spelling of a duration: 86400 -> `24h`, 5400 -> `1h30m`, 0.5 -> `500ms`."""
    if seconds == 0:
        return "0s"
    if seconds < 1:
        return f"{_decimal(seconds * 1000, 6)}ms"
    whole = int(seconds)
    frac = seconds - whole
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    out = ""
    if hours:
        out += f"{hours}h"
    if minutes:
        out += f"{minutes}m"
    if secs or frac:
        out += f"{_decimal(secs + frac, 9)}s"
    return out


def _decimal(value: float, places: int) -> str:
    """`value` to the nanosecond (Go's duration resolution) without trailing zeros or an
    exponent: `:g` kept 6 significant digits, so 10.84375 s came back as 10.8438 s."""
    return f"{value:.{places}f}".rstrip("0").rstrip(".")


_DIGITS = {10: re.compile(r"[0-9]+"), 8: re.compile(r"(?:0o)?[0-7]+"), 16: re.compile(r"(?:0x)?[0-9a-fA-F]+")}


class EnvReader:
    """Typed reads of one environment mapping. Unset and empty mean "use the default".

    `strip=True` trims white space around values first (the node agent's values come from Helm
    and flags, where stray spaces are common); the node proxy passes values through as given,
    as ztunnel does.
    """

    __slots__ = ("env", "_bools", "_strip")

    def __init__(self, env: Mapping[str, str], *, bools: BoolSpelling = ZTUNNEL_BOOLS, strip: bool = False):
        self.env = env
        self._bools = bools
        self._strip = strip

    def raw(self, name: str) -> str | None:
        """The value exactly as set (None when unset), for variables where empty means something."""
        return self.env.get(name)

    def _value(self, name: str) -> str | None:
        value = self.env.get(name)
        if value is None:
            return None
        if self._strip:
            value = value.strip()
        return value or None

    def string(self, name: str, default: str | None = None) -> str | None:
        value = self._value(name)
        return default if value is None else value

    def text(self, name: str, default: str = "") -> str:
        """Like `string`, for settings whose absence is the empty string."""
        value = self._value(name)
        return default if value is None else value

    def parse_bool(self, name: str, value: str) -> bool:
        lowered = value.strip().lower()
        if lowered in self._bools.true:
            return True
        if lowered in self._bools.false:
            return False
        raise ConfigError(name, f"{value!r} is not a boolean; use {self._bools.forms}")

    def boolean(self, name: str, default: bool) -> bool:
        value = self._value(name)
        return default if value is None else self.parse_bool(name, value)

    def optional_boolean(self, name: str) -> bool | None:
        value = self._value(name)
        return None if value is None else self.parse_bool(name, value)

    def integer(self, name: str, default: int, *, minimum: int, maximum: int, base: int = 10) -> int:
        """A whole number in `base` (10, 8 for file modes, 16), within [minimum, maximum]."""
        value = self._value(name)
        if value is None:
            return default
        return self.parse_integer(name, value, minimum=minimum, maximum=maximum, base=base)

    def optional_integer(self, name: str, *, minimum: int, maximum: int) -> int | None:
        value = self._value(name)
        return None if value is None else self.parse_integer(name, value, minimum=minimum, maximum=maximum)

    @staticmethod
    def parse_integer(name: str, value: str, *, minimum: int, maximum: int, base: int = 10) -> int:
        text = value.strip()
        negative = text.startswith("-") and minimum < 0
        digits = text[1:] if negative else text
        if not text.isascii() or _DIGITS[base].fullmatch(digits) is None:
            raise ConfigError(name, f"{value!r} is not a whole number; use {minimum}-{maximum}")
        number = int(digits, base) * (-1 if negative else 1)
        if not minimum <= number <= maximum:
            raise ConfigError(name, f"{number} is out of range; use {minimum}-{maximum}")
        return number

    def duration(
        self,
        name: str,
        default: float,
        *,
        allow_zero: bool = False,
        maximum_s: float | None = None,
    ) -> float:
        """Seconds, from a Go duration (`parse_duration`)."""
        value = self._value(name)
        if value is None:
            return default
        try:
            seconds = parse_duration(value)
        except ValueError:
            raise ConfigError(name, f"{value!r} is not a duration; use {DURATION_FORMS}") from None
        if seconds == 0 and not allow_zero:
            raise ConfigError(name, f"{value!r} must be longer than zero; use {DURATION_FORMS}")
        if maximum_s is not None and seconds > maximum_s:
            raise ConfigError(name, f"{value!r} is out of range; use at most {format_duration(maximum_s)}")
        return seconds

    def optional_duration(self, name: str, *, allow_zero: bool = False) -> float | None:
        if self._value(name) is None:
            return None
        return self.duration(name, 0.0, allow_zero=allow_zero)

    def address(self, name: str, default: SocketAddr) -> SocketAddr:
        value = self._value(name)
        if value is None:
            return default
        try:
            return SocketAddr.parse(value.strip())
        except ProtocolError as e:
            raise ConfigError(
                name, f"{e.message}; use ip:port or [ipv6]:port (port 0 picks a free port)"
            ) from None

    def csv(self, name: str, default: tuple[str, ...]) -> tuple[str, ...]:
        """Comma-separated values; set but empty means "none" (not the default)."""
        value = self.env.get(name)
        if value is None:
            return default
        return tuple(part.strip() for part in value.split(",") if part.strip())
