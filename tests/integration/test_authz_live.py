"""A model of the authorization rule (docs/architecture.md, "Decisions and caches"): every stream
is decided on the state as it is when it arrives, and every open stream is closed once the
state would refuse it, whatever HBONE connection it shares.

Hypothesis interleaves state changes (policies with and without selectors, the destination
workload's policy list as label changes make it, STRICT PeerAuthentication) with streams opened
through the client proxy: on its pooled HBONE connection, or on a fresh one after the pool lets
its connections go (they drain: their open streams stay). After every step each stream's fate is
checked against the reference evaluator (rbac/reference.py) applied to the model's own state:
a new stream is served exactly when the reference allows it, an open stream stays open exactly
as long as the reference allows it. Cross node: the client and server proxies each hold their own
copy of the state, as two nodes do.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field

import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ambient_mesh.identity.spiffe import Identity
from ambient_mesh.net import ip_address
from ambient_mesh.rbac import (
    Action,
    Authorization,
    Clause,
    Match,
    RbacConnection,
    Rule,
    Scope,
    StringMatch,
    policies_for,
    reference,
    strict_mtls_policy,
)
from ambient_mesh.state.model import Workload
from tests.helpers.state_writes import remove, upsert

from .mesh import CLIENT_IP, ECHO_PORT, SERVER_IP, Mesh, echo_handler, running_mesh

OTHER_PORT = ECHO_PORT + 1
STEP_TIMEOUT_S = 10.0
CLIENT_ID = Identity("cluster.local", "default", "client")


def _policy(
    name: str, action: Action, *matches: Match, scope: Scope = Scope.WORKLOAD_SELECTOR
) -> Authorization:
    rules = tuple(Rule(clauses=(Clause(matches=(m,)),)) for m in matches)
    return Authorization(name=name, namespace="default", scope=scope, action=action, rules=rules)


def _principal(sa: str) -> Match:
    return Match(principals=(StringMatch.exact(f"cluster.local/ns/default/sa/{sa}"),))


# What the control plane can send for the server's namespace. Selector policies bind only while the
# server workload lists them (istiod lists the policies whose selector matches its labels).
CATALOGUE: tuple[Authorization, ...] = (
    _policy("deny-client", Action.DENY, _principal("client")),
    _policy("allow-someone-else", Action.ALLOW, _principal("someone-else")),
    _policy("allow-client", Action.ALLOW, _principal("client")),
    _policy("allow-other-port", Action.ALLOW, Match(destination_ports=(OTHER_PORT,))),
    # An ALLOW with only HTTP fields, as istiod sends it to a node proxy: no rule, so it matches
    # nothing and, being an ALLOW, refuses everything.
    _policy("allow-l7-only", Action.ALLOW),
    _policy("ns-deny-other-port", Action.DENY, Match(destination_ports=(OTHER_PORT,)), scope=Scope.NAMESPACE),
    strict_mtls_policy(),
)
SELECTABLE = tuple(p.key for p in CATALOGUE if p.scope is Scope.WORKLOAD_SELECTOR)

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, len(CATALOGUE) - 1)),
        st.tuples(st.just("remove"), st.integers(0, len(CATALOGUE) - 1)),
        st.tuples(st.just("select"), st.sets(st.sampled_from(SELECTABLE))),
        st.tuples(st.just("open"), st.sampled_from([ECHO_PORT, OTHER_PORT])),
        st.tuples(st.just("fresh"), st.just(0)),
    ),
    min_size=1,
    max_size=14,
)


@dataclass
class Model:
    """The state the control plane has sent, as the test sees it."""

    policies: dict[str, Authorization] = field(default_factory=dict)
    selected: tuple[str, ...] = ()

    def allows(self, server: Workload, port: int) -> bool:
        workload = dataclasses.replace(server, authorization_policies=self.selected)
        conn = RbacConnection(
            src_identity=CLIENT_ID,
            src_ip=ip_address(CLIENT_IP),
            dst_ip=ip_address(SERVER_IP),
            dst_port=port,
            dst_network="",
        )
        return reference.evaluate(policies_for(self.policies, workload), conn).allowed


@dataclass
class Stream:
    port: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


async def _round_trip(stream: Stream) -> bool:
    """True when the stream still carries bytes both ways, False when it was closed."""
    try:
        stream.writer.write(b"y")
        await stream.writer.drain()
        return await asyncio.wait_for(stream.reader.read(1), STEP_TIMEOUT_S) == b"y"
    except (ConnectionError, OSError):
        return False


async def _open(mesh: Mesh, port: int) -> Stream | None:
    try:
        reader, writer = await asyncio.wait_for(mesh.socks_connect(SERVER_IP, port), STEP_TIMEOUT_S)
    except (ConnectionRefusedError, ConnectionError, asyncio.IncompleteReadError):
        return None
    stream = Stream(port, reader, writer)
    return stream if await _round_trip(stream) else None


async def _run(ops: list[tuple[str, object]]) -> None:
    other = await asyncio.start_server(echo_handler, SERVER_IP, OTHER_PORT)
    streams: list[Stream] = []
    try:
        async with running_mesh() as mesh:
            states = (mesh.client.state, mesh.server.state)
            server = mesh.server.state.workloads.find_address("", ip_address(SERVER_IP))
            assert server is not None
            model = Model()
            for step, (op, arg) in enumerate(ops):
                if op == "push":
                    policy = CATALOGUE[int(arg)]  # type: ignore[call-overload]
                    model.policies[policy.key] = policy
                    for state in states:
                        upsert(state, policy)
                elif op == "remove":
                    key = CATALOGUE[int(arg)].key  # type: ignore[call-overload]
                    if model.policies.pop(key, None) is not None:
                        for state in states:
                            remove(state, key, policies=True)
                elif op == "select":
                    model.selected = tuple(k for k in SELECTABLE if k in arg)  # type: ignore[operator]
                    for state in states:
                        upsert(state, dataclasses.replace(server, authorization_policies=model.selected))
                elif op == "fresh":
                    assert mesh.client.pi.pool is not None
                    mesh.client.pi.pool.close()  # GOAWAY: its open streams stay, new ones go elsewhere
                elif op == "open":
                    port = int(arg)  # type: ignore[call-overload]
                    stream = await _open(mesh, port)
                    expected = model.allows(server, port)
                    assert (stream is not None) == expected, (
                        f"step {step}: a new stream to port {port} was "
                        f"{'served' if stream else 'refused'}; the reference says "
                        f"{'allow' if expected else 'deny'} ({model})"
                    )
                    if stream is not None:
                        streams.append(stream)
                for stream in list(streams):
                    expected = model.allows(server, stream.port)
                    open_now = await _round_trip(stream)
                    assert open_now == expected, (
                        f"step {step} ({op}): an open stream to port {stream.port} is "
                        f"{'open' if open_now else 'closed'}; the reference says "
                        f"{'allow' if expected else 'deny'} ({model})"
                    )
                    if not open_now:
                        streams.remove(stream)
                        stream.writer.close()
    finally:
        for stream in streams:
            stream.writer.close()
        other.close()
        await other.wait_closed()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_ops)
def test_every_stream_is_decided_on_the_state_it_meets(ops: list[tuple[str, object]]) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(asyncio.wait_for(_run(ops), 120))


def test_a_selector_deny_binds_on_a_pooled_connection_and_closes_its_open_stream() -> None:
    """The lab report, in-process: a connection pooled before a selector DENY arrives carries no
    new stream after it, and the stream open on it is closed."""
    ops: list[tuple[str, object]] = [
        ("open", ECHO_PORT),
        ("push", 0),
        ("select", {CATALOGUE[0].key}),
        ("open", ECHO_PORT),
    ]
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(asyncio.wait_for(_run(ops), 60))
