"""Network namespaces and their wiring, for the lab and the network-namespace tests.

Counterparts: the namespace harness of ztunnel's namespaced tests (one netns per node and per
workload, wired through a shared namespace) and the `ip netns` steps of istio-cni's tests. Every
change goes through a CommandRunner (`ip ...`, `sysctl ...`), and only ever inside namespaces
created here: the host's root namespace is never touched.

Names carry a per-run prefix `am-<pid>-<n>-` so parallel or leftover runs never collide, and
`cleanup_stale_namespaces` removes namespaces whose creating process is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import http.client
import ipaddress
import itertools
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..errors import AmbientError
from .commands import CommandRunner, SubprocessRunner

NETNS_PREFIX = "am-"
NETNS_RUN_DIR = Path("/run/netns")
IFNAME_MAX_CHARS = 15  # IFNAMSIZ - 1
# Linux: <linux/sched.h>; <linux/nsfs.h> NS_GET_NSTYPE = _IO(0xb7, 0x3); <linux/magic.h>.
CLONE_NEWNET = 0x40000000
NS_GET_NSTYPE = 0xB703
NSFS_MAGIC = 0x6E736673
PROC_SUPER_MAGIC = 0x9FA0
_STATFS_BYTES = 256  # larger than struct statfs on every Linux ABI; f_type is its first word

PROCESS_TERM_GRACE_S = 3.0
WAIT_FOR_LISTEN_TIMEOUT_S = 10.0
POLL_INTERVAL_S = 0.05
IO_TIMEOUT_S = 5.0
READ_BYTES = 65536
SO_MARK = getattr(socket, "SO_MARK", 36)  # Linux's value; older Pythons lack the name

DEFAULT_SUBNET = ipaddress.IPv4Network("10.240.0.0/24")
DEFAULT_SUBNET6 = ipaddress.IPv6Network("fd00:240::/64")
FIRST_NODE_HOST = 11  # the first node's host number on the fabric's subnet

_STALE_NAME = re.compile(rf"^{re.escape(NETNS_PREFIX)}(\d+)-")
_run_counter = itertools.count(1)


# --- names -------------------------------------------------------------------------------------


def run_prefix(pid: int | None = None) -> str:
    """A fresh prefix for one fabric of this process: `am-<pid>-<n>-`."""
    return f"{NETNS_PREFIX}{os.getpid() if pid is None else pid}-{next(_run_counter)}-"


def creator_pid(netns: str) -> int | None:
    """The pid encoded in an `am-<pid>-...` name, or None for names that are not ours."""
    match = _STALE_NAME.match(netns)
    return int(match.group(1)) if match else None


def parse_netns_list(text: str) -> list[str]:
    """Names from `ip netns list` output (`name` or `name (id: N)` per line)."""
    names = []
    for line in text.splitlines():
        fields = line.split()
        if fields:
            names.append(fields[0])
    return names


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_namespaces(names: Sequence[str], *, alive: Callable[[int], bool] = pid_alive) -> list[str]:
    """Our namespaces (`am-<pid>-...`) whose creating process no longer exists."""
    stale = []
    for name in names:
        pid = creator_pid(name)
        if pid is not None and not alive(pid):
            stale.append(name)
    return stale


# --- namespaces, links, addresses, routes, sysctls ---------------------------------------------


def list_netns(runner: CommandRunner) -> list[str]:
    return parse_netns_list(runner.run(["ip", "netns", "list"]).text)


def create_netns(runner: CommandRunner, name: str) -> None:
    """Create a named namespace with `lo` up (sockets bound to 127.0.0.1 need it)."""
    runner.run(["ip", "netns", "add", name])
    runner.run(["ip", "-n", name, "link", "set", "lo", "up"])


def delete_netns(runner: CommandRunner, name: str) -> None:
    """Delete a named namespace; its interfaces (and veth peers elsewhere) go with it."""
    runner.run(["ip", "netns", "delete", name], check=False)


def netns_pids(runner: CommandRunner, name: str) -> list[int]:
    result = runner.run(["ip", "netns", "pids", name], check=False)
    return [int(tok) for tok in result.text.split() if tok.isdigit()]


def cleanup_stale_namespaces(
    runner: CommandRunner, *, kill_processes: bool = False, alive: Callable[[int], bool] = pid_alive
) -> list[str]:
    """Delete `am-*` namespaces left by runs that died; return their names.

    With `kill_processes`, processes still inside them are killed first (a deleted namespace
    whose processes live on stays alive, unnamed, and keeps its addresses busy).
    """
    stale = stale_namespaces(list_netns(runner), alive=alive)
    for name in stale:
        if kill_processes:
            for pid in netns_pids(runner, name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        delete_netns(runner, name)
    return stale


def add_veth(runner: CommandRunner, *, netns: str, name: str, peer_netns: str, peer_name: str) -> None:
    """A veth pair with one end in `netns` and the other in `peer_netns`; both left down."""
    for ifname in (name, peer_name):
        if len(ifname) > IFNAME_MAX_CHARS:
            raise AmbientError(f"interface name {ifname!r} is longer than {IFNAME_MAX_CHARS} characters")
    runner.run(
        [
            "ip",
            "-n",
            netns,
            "link",
            "add",
            name,
            "type",
            "veth",
            "peer",
            "name",
            peer_name,
            "netns",
            peer_netns,
        ]
    )


def add_bridge(runner: CommandRunner, *, netns: str, name: str) -> None:
    runner.run(["ip", "-n", netns, "link", "add", name, "type", "bridge"])
    link_up(runner, netns=netns, ifname=name)


def attach_to_bridge(runner: CommandRunner, *, netns: str, ifname: str, bridge: str) -> None:
    runner.run(["ip", "-n", netns, "link", "set", ifname, "master", bridge])


def link_up(runner: CommandRunner, *, netns: str, ifname: str) -> None:
    runner.run(["ip", "-n", netns, "link", "set", ifname, "up"])


def add_address(
    runner: CommandRunner,
    *,
    netns: str,
    ifname: str,
    address: ipaddress.IPv4Interface | ipaddress.IPv6Interface,
) -> None:
    argv = ["ip", "-n", netns, "addr", "add", str(address), "dev", ifname]
    if address.version == 6:
        # Duplicate address detection would hold the address "tentative" (unbindable) for
        # about a second; these are private, collision-free test addresses.
        argv.append("nodad")
    runner.run(argv)


def add_route(
    runner: CommandRunner,
    *,
    netns: str,
    destination: str,
    via: str | None = None,
    dev: str | None = None,
    table: int | str | None = None,
    route_type: str | None = None,
) -> None:
    """`ip route replace [type] <destination> [via ..] [dev ..] [table ..]` in `netns`."""
    argv = ["ip", "-n", netns]
    if destination.count(":") or (via and ":" in via):
        argv.append("-6")
    argv += ["route", "replace"]
    if route_type:
        argv.append(route_type)
    argv.append(destination)
    if via:
        argv += ["via", via]
    if dev:
        argv += ["dev", dev]
    if table is not None:
        argv += ["table", str(table)]
    runner.run(argv)


def set_sysctl(runner: CommandRunner, *, netns: str, key: str, value: str | int) -> None:
    """Set a per-namespace sysctl (ip_forward, route_localnet, ...) inside `netns` only."""
    runner.run(["sysctl", "-q", "-w", f"{key}={value}"], netns=netns)


def listening_ports(runner: CommandRunner, netns: str) -> set[int]:
    """TCP ports with a listener in `netns` (from `ss`, run inside it)."""
    text = runner.run(["ss", "-Hltn"], netns=netns).text
    ports = set()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            _, _, port = fields[3].rpartition(":")
            if port.isdigit():
                ports.add(int(port))
    return ports


def wait_for_listen(
    runner: CommandRunner,
    netns: str,
    port: int,
    *,
    timeout_s: float = WAIT_FOR_LISTEN_TIMEOUT_S,
    process: subprocess.Popen[bytes] | None = None,
) -> None:
    """Block until something listens on TCP `port` inside `netns`.

    Gives up with AmbientError after `timeout_s`, or as soon as `process` (the one expected to
    listen) has exited, so a crashed server fails fast instead of waiting out the deadline.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if port in listening_ports(runner, netns):
            return
        if process is not None and process.poll() is not None:
            raise AmbientError(
                f"process {process.args!r} exited with code {process.returncode} "
                f"before listening on port {port} in netns {netns}"
            )
        if time.monotonic() >= deadline:
            raise AmbientError(f"nothing listens on TCP port {port} in netns {netns} after {timeout_s}s")
        time.sleep(POLL_INTERVAL_S)


# --- entering a namespace from this process -----------------------------------------------------


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _setns(fd: int) -> None:
    if _libc().setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _fstatfs_type(fd: int) -> int:
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc().fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ctypes.c_long.from_buffer(buf).value


def netns_problem(fd: int) -> str | None:
    """None if `fd` looks like a network namespace, else what it is instead.

    As ztunnel does: ask the kernel for the namespace type (NS_GET_NSTYPE); kernels older than
    4.11 do not know that ioctl, so fall back to the filesystem magic (nsfs, or proc for
    /proc/<pid>/ns/net on very old kernels).
    """
    try:
        nstype = fcntl.ioctl(fd, NS_GET_NSTYPE)
    except OSError as e:
        if e.errno == errno.EBADF:
            return "not an open file descriptor"
    else:
        return None if nstype == CLONE_NEWNET else f"a namespace of type {nstype:#x}, not a network namespace"
    try:
        magic = _fstatfs_type(fd)
    except OSError as e:
        return f"cannot fstatfs: {e.strerror}"
    if magic in (NSFS_MAGIC, PROC_SUPER_MAGIC):
        return None
    return f"a file on filesystem {magic:#x}, not nsfs"


@contextlib.contextmanager
def entered(netns: str) -> Iterator[None]:
    """Run the body with the *current thread* inside `netns` (setns(2) is per thread).

    Sockets created in the body stay in `netns` after it ends, which lets a test open a client
    or a listener "inside a pod" without a helper process. Python 3.11 has no os.setns.
    """
    with open("/proc/thread-self/ns/net", "rb") as own, open(NETNS_RUN_DIR / netns, "rb") as target:
        _setns(target.fileno())
        try:
            yield
        finally:
            _setns(own.fileno())


def netns_socket(netns: str, family: int = socket.AF_INET, type: int = socket.SOCK_STREAM) -> socket.socket:
    """A socket that lives in `netns`."""
    with entered(netns):
        return socket.socket(family, type)


def tcp_roundtrip(
    netns: str,
    host: str,
    port: int,
    payload: bytes,
    *,
    mark: int | None = None,
    timeout_s: float = IO_TIMEOUT_S,
) -> bytes:
    """Connect from inside `netns` (as the app there would), send `payload`, half-close, and
    return everything read back until the peer closes.

    `mark` sets SO_MARK on the socket first, to look like traffic the node proxy itself sends.
    """
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    with netns_socket(netns, family) as sock:
        sock.settimeout(timeout_s)
        if mark is not None:
            sock.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)
        sock.connect((host, port))
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(READ_BYTES):
            chunks.append(chunk)
        return b"".join(chunks)


def http_get(
    netns: str, host: str, port: int, path: str, *, timeout_s: float = IO_TIMEOUT_S
) -> tuple[int, bytes]:
    """GET http://host:port/path from inside `netns`; returns (status, body).

    Connection failures raise OSError; a reply that is not HTTP raises http.client.HTTPException.
    """
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        with entered(netns):
            conn.connect()  # only the socket has to be created inside netns; it stays there
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class NetnsHandle:
    """An open network namespace, e.g. a pod's as handed over by the node agent (ZDS).

    `socket(family)` creates a TCP socket inside it: the calling thread enters the namespace,
    creates the socket and returns at once (setns(2) is per thread; a socket keeps the
    namespace it was created in, so bind/connect/listen can follow anywhere).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        st = os.fstat(fd)
        self.key = (st.st_dev, st.st_ino)  # identifies the namespace: same pod, same sandbox

    def __repr__(self) -> str:
        return f"NetnsHandle(fd={self.fd}, inode={self.key[1]})"

    def socket(self, family: int, type: int = socket.SOCK_STREAM) -> socket.socket:
        with open("/proc/thread-self/ns/net", "rb") as home:
            _setns(self.fd)
            try:
                return socket.socket(family, type)
            finally:
                _setns(home.fileno())

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# --- processes in namespaces --------------------------------------------------------------------


def spawn_in_netns(
    netns: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    stdin: int | IO[Any] | None = subprocess.DEVNULL,
) -> subprocess.Popen[bytes]:
    """Start `argv` inside `netns` (through `ip netns exec`) in its own process group."""
    return subprocess.Popen(
        ["ip", "netns", "exec", netns, *argv],
        env=None if env is None else dict(env),
        cwd=cwd,
        stdout=stdout,
        stderr=stderr,
        stdin=stdin,
        start_new_session=True,
    )


def process_group_members(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    """Pids of the processes whose process group is `pgid` (proc(5): field 5 of /proc/<pid>/stat)."""
    members = []
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            stat = (proc / entry.name / "stat").read_bytes()
        except OSError:
            continue  # exited while we listed
        fields = stat.rpartition(b")")[2].split()  # after "pid (comm)": state ppid pgrp ...
        if len(fields) > 2 and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def leftover_group(pgid: int, members: Sequence[int]) -> bool:
    """Are `members` (the processes of group `pgid`) what a reaped leader `pgid` left behind?

    Linux keeps a pid number allocated while any process still uses it as its process group,
    so a group with survivors keeps its leader's pid from being reused. A group that emptied
    frees the number, and a new process given it that calls setsid() (start_new_session: the
    proxies and bench servers of every other test run on this host) forms a new group
    `pgid`, with a member whose pid is `pgid`. That group is not ours and must not be killed.
    """
    return bool(members) and pgid not in members


def stop_process(process: subprocess.Popen[bytes], *, grace_s: float = PROCESS_TERM_GRACE_S) -> int:
    """SIGTERM the process group, SIGKILL it after `grace_s`; return the exit code.

    Signals go to the group only while the leader is unreaped (its pid cannot be reused
    then). For a leader already reaped, the group is killed only if `leftover_group` says its
    members are the leader's leftovers: a blind killpg of a reaped leader's pid SIGKILLed
    other runs' processes that had been given the recycled pid (bench servers refused
    connections mid-run while other test suites ran).
    """
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=grace_s)
    elif leftover_group(process.pid, process_group_members(process.pid)):
        # The leader is gone but children it left in the group are not.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode


# --- the fabric ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    """One namespace on the fabric: a pod (app + its dedicated node proxy) or a plain host."""

    name: str
    netns: str
    ifname: str
    ipv4: ipaddress.IPv4Address
    ipv6: ipaddress.IPv6Address | None


class Fabric:
    """A private L2 network: a "network" namespace holding a bridge, nodes on veth pairs.

    The one network fabric: the netns tests and the benchmarks use it as it is, and the lab
    (`lab/topology.py`) builds its nodes' pod networks on it.

    Layout (all inside namespaces this object creates; the root namespace is never touched):

        <prefix>net:  br0 = <subnet>.1 (+ <subnet6>::1), ip_forward on; one veth port per node
        <prefix><node>: eth0 = <subnet>.<first_node_host + n>, default route via br0's address

    Use as a context manager: teardown always runs, even on exceptions, and stops every process
    started through `spawn` before deleting every namespace created here (nodes' and those added
    with `add_namespace`), newest first. `on_create` is told each namespace's name before it is
    created (the lab's journal records it, so a crashed lab can be cleaned up).
    """

    BRIDGE = "br0"
    NODE_IFNAME = "eth0"

    def __init__(
        self,
        *,
        runner: CommandRunner | None = None,
        subnet: str | ipaddress.IPv4Network = DEFAULT_SUBNET,
        subnet6: str | ipaddress.IPv6Network | None = DEFAULT_SUBNET6,
        prefix: str | None = None,
        first_node_host: int = FIRST_NODE_HOST,
        on_create: Callable[[str], None] | None = None,
    ) -> None:
        self.runner = runner or SubprocessRunner()
        self.subnet = ipaddress.IPv4Network(subnet)
        self.subnet6 = ipaddress.IPv6Network(subnet6) if subnet6 is not None else None
        self.prefix = prefix or run_prefix()
        self.first_node_host = first_node_host
        self.on_create = on_create
        self.network_netns = f"{self.prefix}net"
        self.nodes: dict[str, Node] = {}
        self.processes: list[subprocess.Popen[bytes]] = []
        self._namespaces: list[str] = []
        self._open = False

    def __repr__(self) -> str:
        state = "up" if self._open else "down"
        running = sum(1 for p in self.processes if p.poll() is None)
        return (
            f"Fabric({self.prefix!r}, {state}, {len(self.nodes)} nodes, "
            f"{running} processes running, subnet {self.subnet})"
        )

    @property
    def gateway(self) -> ipaddress.IPv4Address:
        return self.subnet.network_address + 1

    @property
    def gateway6(self) -> ipaddress.IPv6Address | None:
        return None if self.subnet6 is None else self.subnet6.network_address + 1

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this fabric created and has not yet deleted."""
        return list(self._namespaces)

    def __enter__(self) -> Fabric:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def add_namespace(self, name: str) -> None:
        """Create a namespace this fabric owns: deleted at teardown unless `delete_namespace`
        deleted it first."""
        if self.on_create is not None:
            self.on_create(name)
        create_netns(self.runner, name)
        self._namespaces.append(name)

    def delete_namespace(self, name: str) -> None:
        """Delete a namespace (its interfaces, and their veth peers elsewhere, go with it)."""
        delete_netns(self.runner, name)
        with contextlib.suppress(ValueError):
            self._namespaces.remove(name)

    def open(self) -> None:
        if self._open:
            return
        self._open = True
        ns = self.network_netns
        self.add_namespace(ns)
        add_bridge(self.runner, netns=ns, name=self.BRIDGE)
        add_address(
            self.runner,
            netns=ns,
            ifname=self.BRIDGE,
            address=ipaddress.IPv4Interface(f"{self.gateway}/{self.subnet.prefixlen}"),
        )
        set_sysctl(self.runner, netns=ns, key="net.ipv4.ip_forward", value=1)
        if self.subnet6 is not None:
            add_address(
                self.runner,
                netns=ns,
                ifname=self.BRIDGE,
                address=ipaddress.IPv6Interface(f"{self.gateway6}/{self.subnet6.prefixlen}"),
            )
            set_sysctl(self.runner, netns=ns, key="net.ipv6.conf.all.forwarding", value=1)

    def add_node(self, name: str) -> Node:
        """Create a node namespace, plug it into the bridge, give it the next free addresses."""
        if not self._open:
            raise AmbientError("Fabric.add_node called before the fabric was opened")
        if name in self.nodes:
            raise AmbientError(f"fabric already has a node named {name!r}")
        index = len(self.nodes)
        host = self.first_node_host + index
        if host >= self.subnet.num_addresses - 1:
            raise AmbientError(f"subnet {self.subnet} has no room for node {name!r}")
        netns = f"{self.prefix}{name}"
        bridge_port = f"vp{index}"
        self.add_namespace(netns)
        add_veth(
            self.runner,
            netns=netns,
            name=self.NODE_IFNAME,
            peer_netns=self.network_netns,
            peer_name=bridge_port,
        )
        attach_to_bridge(self.runner, netns=self.network_netns, ifname=bridge_port, bridge=self.BRIDGE)
        link_up(self.runner, netns=self.network_netns, ifname=bridge_port)
        ipv4 = self.subnet.network_address + host
        add_address(
            self.runner,
            netns=netns,
            ifname=self.NODE_IFNAME,
            address=ipaddress.IPv4Interface(f"{ipv4}/{self.subnet.prefixlen}"),
        )
        ipv6 = None
        if self.subnet6 is not None:
            ipv6 = self.subnet6.network_address + host
            add_address(
                self.runner,
                netns=netns,
                ifname=self.NODE_IFNAME,
                address=ipaddress.IPv6Interface(f"{ipv6}/{self.subnet6.prefixlen}"),
            )
        link_up(self.runner, netns=netns, ifname=self.NODE_IFNAME)
        # A default route lets apps dial addresses off the subnet (service VIPs) at all: without
        # one, connect() fails with ENETUNREACH before capture rules ever see the packet.
        add_route(self.runner, netns=netns, destination="default", via=str(self.gateway))
        if self.subnet6 is not None:
            add_route(self.runner, netns=netns, destination="default", via=str(self.gateway6))
        node = Node(name=name, netns=netns, ifname=self.NODE_IFNAME, ipv4=ipv4, ipv6=ipv6)
        self.nodes[name] = node
        return node

    def spawn(self, node: Node | str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start a process inside a node's namespace; it is stopped at teardown."""
        netns = node.netns if isinstance(node, Node) else node
        if netns not in self._namespaces:
            raise AmbientError(f"netns {netns!r} does not belong to this fabric")
        process = spawn_in_netns(netns, argv, **kwargs)
        self.processes.append(process)
        return process

    def wait_for_listen(self, node: Node | str, port: int, **kwargs: Any) -> None:
        netns = node.netns if isinstance(node, Node) else node
        wait_for_listen(self.runner, netns, port, **kwargs)

    def _stop_processes(self) -> None:
        # SIGTERM everything first, so the processes drain side by side while the network is
        # still up, then wait for each (stop_process kills what outlives the grace period).
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        for process in reversed(self.processes):
            stop_process(process)
        self.processes.clear()

    def close(self) -> None:
        """Stop processes, then delete namespaces. Safe to call more than once."""
        try:
            try:
                self._stop_processes()
            finally:
                failures: list[BaseException] = []
                for name in reversed(self._namespaces[:]):
                    try:
                        self.delete_namespace(name)
                    except Exception as e:  # the others are still deleted; the first error is raised
                        failures.append(e)
                if failures:
                    raise failures[0]
        finally:
            self._open = False
            self.nodes.clear()
