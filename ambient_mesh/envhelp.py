"""The environment variables a program reads, with their defaults, for its `--help`.

The node proxy (config.py) and the node agent (cni/agent_config.py) read their settings through
one typed reader (env.py `EnvReader`: `string(name, default)`, `boolean(name, default)`, ...). Rather
than keeping a second list that drifts, `env_reads` runs the real loader on an empty environment
with those reader methods observed, and reports every variable in the order the loader reads it
with the default it passed. Variables read directly from the mapping (prefix scans such as
ISTIO_META_*) are reported without a default.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

READER_METHODS = (
    "raw",
    "string",
    "text",
    "boolean",
    "optional_boolean",
    "integer",
    "optional_integer",
    "duration",
    "optional_duration",
    "address",
    "csv",
)
NO_DEFAULT_METHODS = ("raw", "optional_boolean", "optional_integer", "optional_duration")
NO_DEFAULT = object()


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str
    default: Any = NO_DEFAULT
    kind: str = ""
    base: int = 10


class _RecordingEnv(Mapping[str, str]):
    """An empty environment that remembers which names were asked for."""

    def __init__(self, seen: dict[str, EnvVar]) -> None:
        self._seen = seen

    def __getitem__(self, key: str) -> str:
        raise KeyError(key)

    def get(self, key: object, default: Any = None) -> Any:
        if isinstance(key, str):
            self._seen.setdefault(key, EnvVar(key))
        return default

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self._seen.setdefault(key, EnvVar(key))
        return False

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


@contextlib.contextmanager
def _observed(reader_cls: type, seen: dict[str, EnvVar]) -> Iterator[None]:
    originals = {m: getattr(reader_cls, m) for m in READER_METHODS if hasattr(reader_cls, m)}

    def wrap(method: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def observed(self: object, name: str, *args: Any, **kwargs: Any) -> Any:
            default = args[0] if args else kwargs.get("default", NO_DEFAULT)
            if method in NO_DEFAULT_METHODS:
                default = NO_DEFAULT
            previous = seen.get(name)
            if previous is None or previous.default is NO_DEFAULT:
                seen[name] = EnvVar(name, default, method, kwargs.get("base", 10))
            return original(self, name, *args, **kwargs)

        return observed

    try:
        for method, original in originals.items():
            setattr(reader_cls, method, wrap(method, original))
        yield
    finally:
        for method, original in originals.items():
            setattr(reader_cls, method, original)


def env_reads(load: Callable[[Mapping[str, str]], object], reader_cls: type) -> list[EnvVar]:
    """Every variable `load(env)` reads from an empty environment, with the default it uses.
    A variable read without a default (derived later, e.g. XDS_ADDRESS) shows what the loaded
    config holds in the field of the same name, when there is one."""
    seen: dict[str, EnvVar] = {}
    with _observed(reader_cls, seen):
        loaded = load(_RecordingEnv(seen))
    out = []
    for var in seen.values():
        if var.default in (NO_DEFAULT, None):
            value = getattr(loaded, var.name.lower(), None)
            if isinstance(value, (str, int, float)) and not isinstance(value, bool) and value != "":
                var = EnvVar(var.name, value, var.kind, var.base)
        out.append(var)
    return out


def format_env_help(
    variables: list[EnvVar], *, format_default: Callable[[EnvVar], str] = lambda v: str(v.default)
) -> str:
    """`NAME  default` lines for an argparse epilog."""
    width = max((len(v.name) for v in variables), default=0)
    lines = []
    for var in variables:
        if var.default is NO_DEFAULT or var.default is None or var.default == "":
            shown = "(unset)"
        else:
            shown = format_default(var)
        lines.append(f"  {var.name.ljust(width)}  {shown}")
    return "\n".join(lines)


def _format(var: EnvVar) -> str:
    from .env import format_duration

    if isinstance(var.default, bool):
        return "true" if var.default else "false"
    if var.kind == "duration" and isinstance(var.default, (int, float)):
        return format_duration(float(var.default))
    if isinstance(var.default, tuple):
        return ",".join(var.default) or "(empty)"
    if var.kind == "integer" and var.base == 8 and isinstance(var.default, int):
        return f"{var.default:o}"
    return str(var.default)


def ztunnel_env_help() -> str:
    from . import config
    from .env import EnvReader

    variables = env_reads(
        lambda env: config.ZtunnelConfig.from_env(
            env, ipv6_disabled_on_lo=lambda: False, path_exists=lambda _p: False
        ),
        EnvReader,
    )
    prefixes = ", ".join(
        f"{p}*"
        for p in (
            config.ISTIO_META_PREFIX,
            config.ISTIO_METAJSON_PREFIX,
            config.XDS_HEADER_PREFIX,
            config.CA_HEADER_PREFIX,
        )
    )
    return format_env_help(variables, format_default=_format) + f"\n  and the prefixes {prefixes}"


def agent_env_help() -> str:
    from .cni import agent_config
    from .env import EnvReader

    variables = env_reads(lambda env: agent_config.load([], env, hostname="<hostname>"), EnvReader)
    # Settings the loader reads only in some configurations (none in an empty environment).
    named = {v.name for v in variables}
    variables += [EnvVar(name) for name in sorted(agent_config.SETTINGS - named)]
    return format_env_help(variables, format_default=_format)
