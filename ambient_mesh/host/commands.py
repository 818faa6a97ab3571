"""Running host commands (`ip`, `iptables-restore`, `nft`, `sysctl`) through one seam.

Counterparts: istio-cni's `iptables.Dependencies` (RealDependencies / DependenciesStub) and the
`ip netns exec` steps of ztunnel's namespaced test harness. Everything that changes the host goes
through a `CommandRunner`, so rule rendering and namespace wiring can be tested with
`RecordingRunner` and carried out with `SubprocessRunner`.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import AmbientError

COMMAND_TIMEOUT_S = 30.0
STDERR_IN_ERROR_BYTES = 2000
MISSING_BINARY_HINT = "install iptables/nftables/iproute2"


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletedCommand:
    argv: tuple[str, ...]
    returncode: int
    stdout: bytes = b""
    stderr: bytes = b""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def text(self) -> str:
        return self.stdout.decode(errors="replace")


class CommandError(AmbientError):
    """A host command exited non-zero (or could not be started).

    Carries the command, its exit code and stderr so a caller (or an operator reading the log)
    sees exactly what the kernel or the tool refused.
    """

    def __init__(
        self,
        argv: Sequence[str],
        returncode: int | None,
        stderr: bytes | str,
        *,
        netns: str | None = None,
        hint: str | None = None,
    ) -> None:
        stderr_text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
        stderr_text = stderr_text.strip()[:STDERR_IN_ERROR_BYTES]
        where = f" in netns {netns}" if netns else ""
        status = "could not be started" if returncode is None else f"exited with code {returncode}"
        message = f"`{shlex.join(argv)}`{where} {status}"
        if stderr_text:
            message += f": {stderr_text}"
        super().__init__(message, hint=hint)
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr_text
        self.netns = netns


class CommandRunner(Protocol):
    """Runs one command, optionally inside a named network namespace."""

    def run(
        self, argv: Sequence[str], *, input: bytes | None = None, netns: str | None = None, check: bool = True
    ) -> CompletedCommand: ...


def netns_argv(argv: Sequence[str], netns: str | None) -> list[str]:
    """The command line that runs `argv` inside `netns`.

    A name is a namespace under /run/netns (`ip netns exec`). A path (`/proc/<pid>/ns/net`,
    `/var/run/netns/cni-...`, as a container runtime hands pods to the CNI agent) is entered with
    `nsenter --net=<path>`, which, unlike `ip netns exec`, needs no name under /run/netns.
    """
    if netns is None:
        return list(argv)
    if netns.startswith("/"):
        return ["nsenter", f"--net={netns}", "--", *argv]
    return ["ip", "netns", "exec", netns, *argv]


class SubprocessRunner:
    """Runs commands with `subprocess`; non-zero exits raise CommandError when `check` is set.

    A missing binary always raises, whatever `check` says: that is a broken host, not a result.
    """

    def __init__(self, *, timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"SubprocessRunner(timeout_s={self.timeout_s})"

    def run(
        self, argv: Sequence[str], *, input: bytes | None = None, netns: str | None = None, check: bool = True
    ) -> CompletedCommand:
        argv = tuple(argv)
        full = netns_argv(argv, netns)
        try:
            proc = subprocess.run(full, input=input, capture_output=True, timeout=self.timeout_s, check=False)
        except FileNotFoundError as e:
            raise CommandError(argv, None, str(e), netns=netns, hint=MISSING_BINARY_HINT) from None
        except subprocess.TimeoutExpired:
            raise CommandError(argv, None, f"timed out after {self.timeout_s}s", netns=netns) from None
        # `ip netns exec` reports a missing program with its own exit code 255 and this text;
        # nsenter with 127 and "failed to execute".
        if (
            netns is not None
            and proc.returncode in (255, 127)
            and b"No such file or directory" in proc.stderr
            and (b"exec of" in proc.stderr or b"failed to execute" in proc.stderr)
        ):
            raise CommandError(argv, proc.returncode, proc.stderr, netns=netns, hint=MISSING_BINARY_HINT)
        result = CompletedCommand(
            argv=argv, returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr
        )
        if check and not result.ok:
            raise CommandError(argv, result.returncode, result.stderr, netns=netns)
        return result


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordedCall:
    argv: tuple[str, ...]
    input: bytes | None
    netns: str | None
    check: bool


@dataclass(slots=True)
class _CannedResult:
    prefix: tuple[str, ...]
    netns: str | None
    returncode: int
    stdout: bytes
    stderr: bytes
    remaining: int | None  # None = forever


@dataclass(slots=True)
class RecordingRunner:
    """A fake runner for tests: records every call and answers from canned results.

    `respond(prefix, ...)` registers the result for commands starting with `prefix` (the most
    recent registration wins; with `times`, only for that many calls); anything else succeeds
    with empty output. `check` behaves as in
    SubprocessRunner, so callers' error paths are exercised too.
    """

    calls: list[RecordedCall] = field(default_factory=list)
    _canned: list[_CannedResult] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"RecordingRunner({len(self.calls)} calls, {len(self._canned)} canned results)"

    def respond(
        self,
        prefix: Sequence[str],
        *,
        returncode: int = 0,
        stdout: bytes | str = b"",
        stderr: bytes | str = b"",
        netns: str | None = None,
        times: int | None = None,
    ) -> None:
        self._canned.append(
            _CannedResult(
                prefix=tuple(prefix),
                netns=netns,
                returncode=returncode,
                remaining=times,
                stdout=stdout.encode() if isinstance(stdout, str) else stdout,
                stderr=stderr.encode() if isinstance(stderr, str) else stderr,
            )
        )

    def run(
        self, argv: Sequence[str], *, input: bytes | None = None, netns: str | None = None, check: bool = True
    ) -> CompletedCommand:
        argv = tuple(argv)
        self.calls.append(RecordedCall(argv=argv, input=input, netns=netns, check=check))
        result = CompletedCommand(argv=argv, returncode=0)
        for canned in reversed(self._canned):
            if canned.remaining == 0:
                continue
            if argv[: len(canned.prefix)] == canned.prefix and canned.netns in (None, netns):
                if canned.remaining is not None:
                    canned.remaining -= 1
                result = CompletedCommand(
                    argv=argv, returncode=canned.returncode, stdout=canned.stdout, stderr=canned.stderr
                )
                break
        if check and not result.ok:
            raise CommandError(argv, result.returncode, result.stderr, netns=netns)
        return result

    @property
    def argvs(self) -> list[tuple[str, ...]]:
        """Just the command lines, in order (what most assertions want)."""
        return [call.argv for call in self.calls]
