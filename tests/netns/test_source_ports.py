"""A bound source address does not use up the ephemeral ports (host/sockets.py `bind_source`).

The proxy binds a workload's own address (or, with original-source preservation, the client's)
before it connects. Without IP_BIND_ADDRESS_NO_PORT such a bind takes a port no other socket on
that address holds, whatever its peer; with it the port is picked at connect(), per 4-tuple.
The attack: a namespace whose ephemeral range is a few ports, all of them held by connections
from the source address to one destination; a connection to another destination must still go.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from ambient_mesh.host.commands import SubprocessRunner

PORTS_IN_RANGE = 8

SCRIPT = textwrap.dedent(
    f"""
    import errno, ipaddress, json, socket, subprocess
    from ambient_mesh.host.sockets import IP_BIND_ADDRESS_NO_PORT, bind_source

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    # The listeners first: a port bound by bind() is skipped by connect()'s search.
    a, b = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    with open("/proc/sys/net/ipv4/ip_local_port_range", "w") as f:
        f.write("40000 {40000 + PORTS_IN_RANGE - 1}")
    src = ipaddress.ip_address("127.0.0.2")
    report = {{}}

    probe = socket.socket()
    bind_source(probe, src)
    report["option"] = probe.getsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT)
    report["port_after_bind"] = probe.getsockname()[1]
    probe.close()

    held = []
    for _ in range({PORTS_IN_RANGE}):
        s = socket.socket()
        bind_source(s, src)
        s.connect(a.getsockname())
        held.append(s)
    report["held"] = len(held)

    plain = socket.socket()
    try:
        plain.bind(("127.0.0.2", 0))
        report["plain_bind"] = "bound"
    except OSError as e:
        report["plain_bind"] = errno.errorcode[e.errno]
    plain.close()

    other = socket.socket()
    bind_source(other, src)
    other.connect(b.getsockname())
    report["to_other_destination"] = other.getsockname()[0]
    print(json.dumps(report))
    """
)


def test_source_bind_leaves_the_port_to_connect_so_a_full_range_still_reaches_another_peer():
    name = f"am-{os.getpid()}-srcports"
    runner = SubprocessRunner()
    runner.run(["ip", "netns", "add", name])
    try:
        out = subprocess.run(
            ["ip", "netns", "exec", name, sys.executable, "-c", SCRIPT],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    finally:
        runner.run(["ip", "netns", "delete", name])
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["option"] == 1
    assert report["port_after_bind"] == 0  # a plain bind would have taken a port here
    assert report["held"] == PORTS_IN_RANGE
    # The range is used up for a plain bind, so the check below is a real one.
    assert report["plain_bind"] == "EADDRINUSE"
    assert report["to_other_destination"] == "127.0.0.2"
