"""The control plane at mesh scale: translation, delta ADS pushes, and the node proxy's apply.

What istiod's own scale work watches for ambient, measured on this project's code: how long and
how much memory it takes to turn a mesh of Kubernetes objects into `istio.workload.Address` and
`istio.security.Authorization` resources, to pack and version them for delta ADS, to get all of
them to a connected node proxy over real gRPC on 127.0.0.1, and what one small change costs end
to end. Two scales: 1,000 pods / 100 services / 100 AuthorizationPolicies (the warm-up point) and
10,000 / 1,000 / 1,000.

The mesh is generated as one YAML document stream (namespaces, nodes, services, pods owned by
ReplicaSets, policies, one mesh-wide STRICT PeerAuthentication) and parsed by
`control.kube.parse_documents`, as `ambient control` reads its directory.

Processes (multiprocessing, spawn), so each one's memory is its own:

  control plane  parse -> KubeStore -> translation -> AdsServer, then serves delta ADS
                 (grpc.aio, insecure, 127.0.0.1, ephemeral port); nothing else, so its peak RSS
                 is the control plane's
  node proxy     the real XdsClient + XdsSession + StateUpdater into a ProxyState; the session and
                 updater are subclassed only to record timestamps and sizes
  extras         the full `translate` (the reference, and what every change cost before the
                 AmbientIndex), the start-up stages again under tracemalloc, profiles
  decoders       (--compare-decoders) the YAML decode alone, pure-Python PyYAML against libyaml

`--mode incremental` (default) is what ControlPlane.apply does now: the AmbientIndex translates,
AdsServer.apply pushes the delta. `--mode full` is what it did before (translate everything,
AdsServer.update), and runs on trees from before the AmbientIndex, so before/after figures can
come from one bench in the same conditions.

Stages are timed (wall and this process's CPU time) without tracemalloc; tracemalloc numbers come
from the extras process. tracemalloc does not see protobuf (upb) or gRPC core memory, so RSS is
reported too: the change across the stage and the stage's peak above its start (VmHWM after a
reset through /proc/self/clear_refs); the process's peak is kept across those resets.

One object changed (each --repeats times): one pod turns not-ready, one policy gets a different
principal. The control plane builds the new snapshot (KubeStore, as the directory watcher hands
it), translates and pushes, as ControlPlane.apply does; the proxy reports when the push was
applied and what it contained; the control plane reports how many resources it queued, per type.

    .venv/bin/python bench/control_plane_bench.py [--scale 1k|10k|all] [--repeats 3]
        [--mode incremental|full] [--compare-decoders] [--timeout-s 300] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import gc
import io
import ipaddress
import json
import multiprocessing
import os
import platform
import pstats
import re
import statistics
import sys
import time
import traceback
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).resolve().parent / "results" / "control_plane.json"

SERVICES_PER_NAMESPACE = 10
PODS_PER_NODE = 100
TRUST_DOMAIN = "cluster.local"
CLUSTER_ID = "Kubernetes"  # MeshSettings' default, which the workload uids carry
CREATED = "2024-05-01T10:00:00Z"
PROFILE_TOP = 15

ADDRESS = "type.googleapis.com/istio.workload.Address"
AUTHORIZATION = "type.googleapis.com/istio.security.Authorization"
SHORT = {ADDRESS: "Address", AUTHORIZATION: "Authorization"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Scale:
    name: str
    pods: int
    services: int
    policies: int

    @property
    def namespaces(self) -> int:
        return max(1, self.services // SERVICES_PER_NAMESPACE)

    @property
    def nodes(self) -> int:
        return max(1, self.pods // PODS_PER_NODE)


SCALES = {
    "1k": Scale(name="1k", pods=1_000, services=100, policies=100),
    "10k": Scale(name="10k", pods=10_000, services=1_000, policies=1_000),
}


# -- the generated mesh ---------------------------------------------------------------------------


def _pod_ip(k: int) -> str:
    return str(ipaddress.IPv4Address(0x0AF40000 + k + 1))  # 10.244.0.1 ...


def _cluster_ip(s: int) -> str:
    return str(ipaddress.IPv4Address(0x0A600000 + s + 1))  # 10.96.0.1 ...


def _service_namespace(scale: Scale, s: int) -> str:
    return f"ns-{s % scale.namespaces}"


def pod_name(k: int, scale: Scale) -> tuple[str, str]:
    """(namespace, name) of pod k: pods are spread round-robin over the services."""
    s = k % scale.services
    return _service_namespace(scale, s), f"svc-{s}-{s:08x}-{k:05x}"


def policy_name(p: int, scale: Scale) -> tuple[str, str]:
    return f"ns-{p % scale.namespaces}", f"authz-{p}"


def mesh_yaml(scale: Scale) -> str:
    """The whole mesh as one multi-document YAML stream, as `kubectl get -o yaml` would split it."""
    docs: list[str] = [
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: istio-system\n",
        # Mesh-wide STRICT mTLS: the common production setting; it adds the static strict policy.
        "apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata:\n  name: default\n"
        f'  namespace: istio-system\n  creationTimestamp: "{CREATED}"\nspec:\n  mtls:\n    mode: STRICT\n',
    ]
    for n in range(scale.namespaces):
        docs.append(
            f"apiVersion: v1\nkind: Namespace\nmetadata:\n  name: ns-{n}\n  labels:\n"
            "    istio.io/dataplane-mode: ambient\n"
        )
    for i in range(scale.nodes):
        docs.append(
            f"apiVersion: v1\nkind: Node\nmetadata:\n  name: node-{i}\n  labels:\n"
            f"    topology.kubernetes.io/region: region-1\n    topology.kubernetes.io/zone: zone-{i % 3}\n"
        )
    for s in range(scale.services):
        ns = _service_namespace(scale, s)
        docs.append(
            f"apiVersion: v1\nkind: Service\nmetadata:\n  name: svc-{s}\n  namespace: {ns}\n"
            f'  uid: 5e{s:030x}\n  creationTimestamp: "{CREATED}"\n  labels:\n    app: svc-{s}\n'
            f"spec:\n  type: ClusterIP\n  selector:\n    app: svc-{s}\n  clusterIP: {_cluster_ip(s)}\n"
            f"  clusterIPs:\n  - {_cluster_ip(s)}\n  ipFamilies:\n  - IPv4\n  ports:\n"
            "  - name: http\n    port: 80\n    targetPort: http\n    protocol: TCP\n"
            "  - name: grpc\n    port: 9090\n    targetPort: 9090\n    protocol: TCP\n"
        )
    for k in range(scale.pods):
        s = k % scale.services
        ns, name = pod_name(k, scale)
        rs_hash = f"{s:08x}"
        ip = _pod_ip(k)
        docs.append(
            f"apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {ns}\n"
            f'  generateName: svc-{s}-{rs_hash}-\n  uid: 9d{k:030x}\n  creationTimestamp: "{CREATED}"\n'
            f'  labels:\n    app: svc-{s}\n    version: v1\n    pod-template-hash: "{rs_hash}"\n'
            f"  ownerReferences:\n  - apiVersion: apps/v1\n    kind: ReplicaSet\n    name: svc-{s}-{rs_hash}\n"
            "    controller: true\n"
            f"spec:\n  nodeName: node-{k % scale.nodes}\n  serviceAccountName: sa-{s}\n  containers:\n"
            "  - name: app\n    ports:\n    - name: http\n      containerPort: 8080\n      protocol: TCP\n"
            "    - name: grpc\n      containerPort: 9090\n      protocol: TCP\n"
            f"status:\n  phase: Running\n  podIP: {ip}\n  podIPs:\n  - ip: {ip}\n  conditions:\n"
            '  - type: Ready\n    status: "True"\n'
        )
    for p in range(scale.policies):
        docs.append(_policy_yaml(p, scale, principal_suffix=""))
    return "---\n".join(docs)


def _policy_yaml(p: int, scale: Scale, *, principal_suffix: str) -> str:
    """Four shapes, cycling within each namespace: namespace-wide ALLOW, two ALLOWs selecting
    one service's pods (by principal, by IP block), and a DENY from other namespaces."""
    ns, name = policy_name(p, scale)
    n = p % scale.namespaces
    j = p // scale.namespaces
    s = n + scale.namespaces * (j % max(1, scale.services // scale.namespaces))
    head = (
        f"apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata:\n  name: {name}\n"
        f'  namespace: {ns}\n  creationTimestamp: "{CREATED}"\nspec:\n'
    )
    selector = f"  selector:\n    matchLabels:\n      app: svc-{s}\n"
    peer = (s + 1) % scale.services
    variant = j % 4
    if variant == 0:
        body = f"  action: ALLOW\n  rules:\n  - from:\n    - source:\n        namespaces:\n        - {ns}\n        - istio-system\n"
    elif variant == 1:
        body = (
            selector + "  action: ALLOW\n  rules:\n  - from:\n    - source:\n        principals:\n"
            f"        - {TRUST_DOMAIN}/ns/{_service_namespace(scale, peer)}/sa/sa-{peer}{principal_suffix}\n"
            '    to:\n    - operation:\n        ports:\n        - "8080"\n'
        )
    elif variant == 2:
        body = (
            selector + "  action: ALLOW\n  rules:\n  - from:\n    - source:\n        ipBlocks:\n"
            '        - 10.244.0.0/16\n    to:\n    - operation:\n        ports:\n        - "8080"\n'
            '        - "9090"\n'
        )
    else:
        body = (
            selector + "  action: DENY\n  rules:\n  - from:\n    - source:\n        notNamespaces:\n"
            f'        - {ns}\n    to:\n    - operation:\n        ports:\n        - "9090"\n'
        )
    return head + body


# -- measuring ------------------------------------------------------------------------------------


def proc_status() -> dict[str, int]:
    """VmRSS / VmHWM and friends from /proc/self/status, in KiB."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return {}
    return {k: int(v) for k, v in re.findall(r"^(Vm\w+):\s+(\d+) kB", text, re.M)}


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so a stage's own peak can be read."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _all(iterator) -> list:
    return list(iterator)


_PEAK_KIB = [0]  # the process's VmHWM before every reset: resets must not hide its true peak


def peak_rss_kib() -> int:
    """The process's peak RSS over its whole life, across `reset_peak_rss` calls."""
    _PEAK_KIB[0] = max(_PEAK_KIB[0], proc_status().get("VmHWM", 0))
    return _PEAK_KIB[0]


def measure(fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """Run `fn` once, untraced: wall and CPU time, RSS change, and the stage's peak RSS above its
    start. CPU time is this process's alone, so it moves less than wall time on a shared host."""
    gc.collect()
    peak_rss_kib()
    before = proc_status()
    reset = reset_peak_rss()
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    after = proc_status()
    peak_rss_kib()
    return out, {
        "seconds": seconds,
        "cpu_s": cpu_s,
        "rss_before_kib": before.get("VmRSS"),
        "rss_delta_kib": after.get("VmRSS", 0) - before.get("VmRSS", 0),
        "rss_peak_over_start_kib": after.get("VmHWM", 0) - before.get("VmRSS", 0) if reset else None,
    }


def traced(fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """Run `fn` once under tracemalloc: Python-heap peak and what is still held afterwards."""
    gc.collect()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    try:
        out = fn()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, {"traced_peak_kib": (peak - base) // 1024, "traced_retained_kib": (current - base) // 1024}


def profile_top(fn: Callable[[], Any], limit: int = PROFILE_TOP) -> list[str]:
    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    return _top(prof, limit)


def _top(prof: cProfile.Profile, limit: int) -> list[str]:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(limit)
    lines = [line.rstrip() for line in buf.getvalue().splitlines()]
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return [line for line in lines[start:] if line.strip()]


# -- process plumbing -----------------------------------------------------------------------------


def _serve_commands(conn, handler: Callable[[tuple], Any]) -> None:
    """A child's main: run the async handler loop, reporting any failure to the parent."""

    async def main() -> None:
        try:
            await handler(conn)
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            raise

    try:
        asyncio.run(main())
    finally:
        conn.close()


def call(conn, message: tuple | None, timeout_s: float) -> Any:
    """Send a command to a child (or only wait, with None) and return its answer."""
    if message is not None:
        conn.send(message)
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no answer within {timeout_s:.0f} s to {message!r}")
    tag, payload = conn.recv()
    if tag == "error":
        raise RuntimeError(f"child process failed:\n{payload}")
    return payload


# -- the control plane process --------------------------------------------------------------------


def decoders_entry(conn, scale_name: str) -> None:
    """The YAML decode alone, pure-Python PyYAML against libyaml, in a process of its own so the
    memory it leaves behind does not count against the control plane's."""
    import yaml

    text = mesh_yaml(SCALES[scale_name])
    stages: dict[str, dict[str, Any]] = {}
    _, stages["decode_pyyaml"] = measure(partial(_all, yaml.safe_load_all(text)))
    _, stages["decode_libyaml"] = measure(partial(_all, yaml.load_all(text, Loader=yaml.CSafeLoader)))
    conn.send(("ok", stages))
    conn.close()


def control_plane_entry(conn, scale_name: str, mode: str) -> None:
    _serve_commands(conn, lambda c: _control_plane(c, SCALES[scale_name], mode))


class _Full:
    """What ControlPlane.apply did before the AmbientIndex: translate everything, update all."""

    def __init__(self, ads) -> None:
        self.ads = ads

    def load(self, store) -> Any:
        from ambient_mesh.control.translate import translate

        self.translation = translate(store)
        return self.translation

    def push(self, _loaded) -> int:
        return self.ads.update(self.translation.addresses, self.translation.authorizations)

    def change(self, store, key) -> Any:
        return self.load(store)

    def counts(self) -> tuple[int, int, int, int, int]:
        return _counts(
            self.translation.addresses, len(self.translation.authorizations), len(self.translation.notes)
        )


class _Incremental:
    """What ControlPlane.apply does: the AmbientIndex translates what changed, ADS gets the delta."""

    def __init__(self, ads) -> None:
        from ambient_mesh.control.plane import KubeNodeIndex
        from ambient_mesh.control.translate import AmbientIndex

        self.ads = ads
        self.index = AmbientIndex()
        self.nodes = KubeNodeIndex(TRUST_DOMAIN)  # the CA's pod index, updated with every change

    def load(self, store) -> Any:
        delta = self.index.update(store)
        self.nodes.update(store, delta.objects)
        return delta

    def push(self, delta) -> int:
        return self.ads.apply(
            addresses=delta.addresses,
            removed_addresses=delta.removed_addresses,
            authorizations=delta.authorizations,
            removed_authorizations=delta.removed_authorizations,
        )

    def change(self, store, key) -> Any:
        delta = self.index.update(store, [key])
        self.nodes.update(store, delta.objects)
        return delta

    def counts(self) -> tuple[int, int, int, int, int]:
        return _counts(self.index.addresses, len(self.index.authorizations), len(self.index.notes))


def _counts(addresses, authorizations: int, notes: int) -> tuple[int, int, int, int, int]:
    """(workloads, services, authorizations, notes, policy references of all workloads)."""
    workloads = [a.workload for a in addresses.values() if a.WhichOneof("type") == "workload"]
    refs = sum(len(w.authorization_policies) for w in workloads)
    return len(workloads), len(addresses) - len(workloads), authorizations, notes, refs


def extras_entry(conn, scale_name: str, mode: str, profile: bool) -> None:
    """The bench's own extras, in a process of their own so the control plane's memory is its
    own: the full translation (the reference, and what every change cost before the index), the
    start-up stages again under tracemalloc, and profiles."""
    from ambient_mesh.control.ads import AdsServer
    from ambient_mesh.control.translate import translate
    from ambient_mesh.kube.load import parse_documents
    from ambient_mesh.kube.store import KubeStore

    scale = SCALES[scale_name]
    text = mesh_yaml(scale)
    store = KubeStore(parse_documents(text, "mesh.yaml").objects)
    del text
    stages: dict[str, dict[str, Any]] = {}
    _, stages["translate"] = measure(partial(translate, store))
    _, extra = traced(partial(translate, store))
    stages["translate"].update(extra)
    fresh = _Incremental(AdsServer()) if mode == "incremental" else _Full(AdsServer())
    loaded, stages["load"] = traced(partial(fresh.load, store))
    _, stages["update"] = traced(partial(fresh.push, loaded))
    del loaded, fresh
    profiles: dict[str, list[str]] = {}
    if profile:
        text = mesh_yaml(scale)
        profiles["parse"] = profile_top(partial(parse_documents, text, "mesh.yaml"))
        del text
        profiles["translate"] = profile_top(partial(translate, store))
        fresh = _Incremental(AdsServer()) if mode == "incremental" else _Full(AdsServer())
        profiles["load"] = profile_top(partial(fresh.load, store))
        fresh = _Incremental(AdsServer()) if mode == "incremental" else _Full(AdsServer())
        loaded = fresh.load(store)
        profiles["update"] = profile_top(partial(fresh.push, loaded))
        del loaded, fresh
    conn.send(("ok", {"stages": stages, "profiles": profiles}))
    conn.close()


async def _control_plane(conn, scale: Scale, mode: str) -> None:
    import grpc

    from ambient_mesh.control.ads import SERVER_OPTIONS, AdsServer
    from ambient_mesh.kube.load import parse_documents
    from ambient_mesh.kube.model import object_key
    from ambient_mesh.kube.store import KubeStore

    stages: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    text = mesh_yaml(scale)
    generate_s = time.perf_counter() - t0
    yaml_bytes, yaml_documents = len(text), text.count("\n---\n") + 1

    # What the control plane does at start-up, in its order: parse, snapshot, translate, serve.
    parsed, stages["parse"] = measure(partial(parse_documents, text, "mesh.yaml"))
    if parsed.errors:
        raise AssertionError(f"generated mesh does not parse: {parsed.errors[:3]}")
    del text  # `ambient control` does not keep the files' text either
    store, stages["store"] = measure(partial(KubeStore, parsed.objects))
    objects_count = len(parsed.objects)
    del parsed
    ads = AdsServer()
    path = _Incremental(ads) if mode == "incremental" else _Full(ads)
    loaded, stages["load"] = measure(partial(path.load, store))
    _, stages["update"] = measure(partial(path.push, loaded))
    del loaded
    gc.collect()
    serving_peak_kib = peak_rss_kib()
    serving_rss_kib = proc_status().get("VmRSS")

    workloads, services, authorizations, notes, policy_refs = path.counts()
    summary = {
        "mode": mode,
        "yaml_bytes": yaml_bytes,
        "yaml_documents": yaml_documents,
        "generate_s": generate_s,
        "objects": objects_count,
        "store": repr(store),
        "workloads": workloads,
        "services": services,
        "authorizations": authorizations,
        "notes": notes,
        "serialized_bytes": {
            SHORT[t]: sum(len(r.resource.value) for r in ads.snapshot.of(t).values())
            for t in (ADDRESS, AUTHORIZATION)
        },
        "workload_policy_refs": policy_refs,
        "serving_rss_kib": serving_rss_kib,
        "serving_peak_rss_kib": serving_peak_kib,
    }

    server = grpc.aio.server(options=SERVER_OPTIONS)
    ads.serve(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    conn.send(("ready", {"port": port, "stages": stages, "summary": summary}))

    objects = {object_key(o): o for o in store.all()}
    try:
        while True:
            command = await asyncio.to_thread(conn.recv)
            match command:
                case ("mutate", kind, index):
                    conn.send(("ok", _mutate(path, objects, scale, kind, index)))
                case ("stop",):
                    status = proc_status()
                    conn.send(
                        (
                            "ok",
                            {
                                "rss_kib": status.get("VmRSS"),
                                "rss_peak_kib": peak_rss_kib(),
                                "connections": len(ads.connections()),
                            },
                        )
                    )
                    return
                case _:
                    raise ValueError(f"unknown command {command!r}")
    finally:
        await server.stop(grace=None)


def _sent_by_type(ads) -> dict[str, int]:
    out = {SHORT[t]: 0 for t in (ADDRESS, AUTHORIZATION)}
    for info in ads.connections():
        for status in info.types:
            out[SHORT[status.type_url]] += status.resources_sent
    return out


def _mutate(path, objects: dict, scale: Scale, kind: str, index: int) -> dict[str, Any]:
    """Change one object, then do what ControlPlane.apply does with a DirectoryChange: the new
    snapshot (KubeStore), translate (all of it, or the index's delta), push."""
    from ambient_mesh.kube.load import parse_documents
    from ambient_mesh.kube.model import PodCondition
    from ambient_mesh.kube.store import KubeStore

    if kind == "pod":
        k = (index * 7919 + 13) % scale.pods  # a different pod each time, spread over namespaces
        ns, name = pod_name(k, scale)
        key = ("Pod", ns, name)
        objects[key] = dataclasses.replace(
            objects[key], conditions=(PodCondition(type="Ready", status="False"),)
        )
        expected = f"{CLUSTER_ID}//Pod/{ns}/{name}"
    elif kind == "policy":
        # Policies of the "by principal" shape: j % 4 == 1, i.e. p in [namespaces, 2 * namespaces).
        p = scale.namespaces + index % scale.namespaces
        ns, name = policy_name(p, scale)
        (new,) = parse_documents(
            _policy_yaml(p, scale, principal_suffix=f"-v{index + 2}"), "edit.yaml"
        ).objects
        key = ("AuthorizationPolicy", ns, name)
        objects[key] = new
        expected = f"{ns}/{name}"
    else:
        raise ValueError(kind)
    gc.collect()
    ads = path.ads
    c0, t0 = time.process_time(), time.monotonic()
    store = KubeStore(objects.values())
    c1, t1 = time.process_time(), time.monotonic()
    loaded = path.change(store, key)
    t2 = time.monotonic()
    before = _sent_by_type(ads)
    queued = path.push(loaded)
    c3, t3 = time.process_time(), time.monotonic()
    after = _sent_by_type(ads)
    return {
        "expected": expected,
        "t_start": t0,
        "t_translate_start": t1,
        "t_update_start": t2,
        "store_s": t1 - t0,
        "translate_s": t2 - t1,
        "update_s": t3 - t2,
        "control_plane_cpu_s": c3 - c0,
        "control_plane_cpu_after_store_s": c3 - c1,
        "responses_queued": queued,
        "resources_queued": {t: after[t] - before[t] for t in after},
    }


# -- the node proxy process -----------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class PushRecord:
    type_url: str
    resources: int
    removed: int
    names: list[str]
    wire_bytes: int
    received_at: float
    decode_s: float
    apply_s: float = 0.0
    applied_at: float = 0.0


@dataclass(slots=True)
class PushLog:
    """Every response the proxy handled, with its timings; lets the driver wait for one."""

    records: list[PushRecord] = field(default_factory=list)
    waiters: list[tuple[Callable[[], bool], asyncio.Future]] = field(default_factory=list)

    def decoded(self, response, push, started: float, ended: float) -> None:
        names = [a.name for a in push.added[:5]] + [f"-{n}" for n in push.removed[:5]]
        self.records.append(
            PushRecord(
                type_url=response.type_url,
                resources=len(push.added),
                removed=len(push.removed),
                names=names,
                wire_bytes=response.ByteSize(),
                received_at=started,
                decode_s=ended - started,
            )
        )

    def applied(self, started: float, ended: float) -> None:
        record = self.records[-1]
        record.apply_s, record.applied_at = ended - started, ended
        for predicate, future in list(self.waiters):
            if not future.done() and predicate():
                future.set_result(None)

    async def wait(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        if predicate():
            return
        future = asyncio.get_running_loop().create_future()
        self.waiters.append((predicate, future))
        try:
            await asyncio.wait_for(future, timeout_s)
        finally:
            self.waiters.remove((predicate, future))


def proxy_entry(conn, port: int, timeout_s: float) -> None:
    _serve_commands(conn, lambda c: _proxy(c, port, timeout_s))


async def _proxy(conn, port: int, timeout_s: float) -> None:
    from ambient_mesh.config import ZtunnelConfig
    from ambient_mesh.state.store import ProxyState
    from ambient_mesh.xds.client import XdsClient
    from ambient_mesh.xds.session import XdsSession, build_node
    from ambient_mesh.xds.updater import StateUpdater

    class TimedSession(XdsSession):
        """The real session; records when each response arrived and how long decoding took."""

        def __init__(self, node, on_demand: bool, log: PushLog) -> None:
            super().__init__(node, on_demand)
            self.push_log = log

        def handle_response(self, response):
            started = time.monotonic()
            outcome = super().handle_response(response)
            self.push_log.decoded(response, outcome.push, started, time.monotonic())
            return outcome

    class TimedUpdater(StateUpdater):
        """The real updater; records how long each apply took."""

        def __init__(self, state: ProxyState, log: PushLog) -> None:
            super().__init__(state)
            self.push_log = log

        def apply_push(self, push):
            started = time.monotonic()
            summary = super().apply_push(push)
            self.push_log.applied(started, time.monotonic())
            return summary

    config = ZtunnelConfig.from_env(
        {
            "XDS_ADDRESS": f"http://127.0.0.1:{port}",
            "POD_NAME": "ztunnel-bench",
            "POD_NAMESPACE": "istio-system",
            "NODE_NAME": "node-0",
        },
        ipv6_disabled_on_lo=lambda: False,
    )
    client: XdsClient | None = None
    log = PushLog()
    armed = 0

    async def connect(*, trace: bool, profile: bool) -> dict[str, Any]:
        nonlocal client, log
        log = PushLog()
        gc.collect()
        before = proc_status()
        reset = reset_peak_rss()
        prof = cProfile.Profile() if profile else None
        if trace:
            tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0] if trace else 0
        if prof is not None:
            prof.enable()
        state = ProxyState()
        session = TimedSession(build_node(config), config.xds_on_demand, log)
        client = XdsClient(config, TimedUpdater(state, log), session=session)
        started = time.monotonic()
        client.start()
        await asyncio.wait_for(client.ready.wait(), timeout_s)
        ready_at = time.monotonic()
        if prof is not None:
            prof.disable()
        out: dict[str, Any] = {}
        if trace:
            current, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            out.update(traced_peak_kib=(peak - base) // 1024, traced_retained_kib=(current - base) // 1024)
        after = proc_status()
        first = log.records[0]
        out.update(
            connect_to_ready_s=ready_at - started,
            connect_to_first_response_s=first.received_at - started,
            first_response_to_ready_s=ready_at - first.received_at,
            decode_s=sum(r.decode_s for r in log.records),
            apply_s=sum(r.apply_s for r in log.records),
            responses=[
                {
                    "type": SHORT.get(r.type_url, r.type_url),
                    "resources": r.resources,
                    "wire_bytes": r.wire_bytes,
                    "decode_s": r.decode_s,
                    "apply_s": r.apply_s,
                }
                for r in log.records
            ],
            workloads=len(state.workloads),
            services=len(state.services),
            policies=len(state.policies),
            rss_before_kib=before.get("VmRSS"),
            rss_delta_kib=after.get("VmRSS", 0) - before.get("VmRSS", 0),
            rss_peak_over_start_kib=after.get("VmHWM", 0) - before.get("VmRSS", 0) if reset else None,
            client=repr(client),
        )
        if prof is not None:
            out["profile"] = _top(prof, PROFILE_TOP)
        return out

    try:
        while True:
            command = await asyncio.to_thread(conn.recv)
            match command:
                case ("connect", options):
                    conn.send(("ok", await connect(**options)))
                case ("arm",):
                    armed = len(log.records)
                    conn.send(("ok", armed))
                case ("await", type_url):
                    mark = armed
                    await log.wait(
                        lambda mark=mark, type_url=type_url: any(
                            r.type_url == type_url and r.applied_at for r in log.records[mark:]
                        ),
                        timeout_s,
                    )
                    seen = log.records[mark:]
                    target = next(r for r in seen if r.type_url == type_url)
                    conn.send(
                        (
                            "ok",
                            {
                                "pushes": [
                                    (SHORT.get(r.type_url, r.type_url), r.names, r.resources, r.removed)
                                    for r in seen[: seen.index(target) + 1]
                                ],
                                "received_at": target.received_at,
                                "applied_at": target.applied_at,
                                "decode_s": target.decode_s,
                                "apply_s": target.apply_s,
                                "wire_bytes": target.wire_bytes,
                            },
                        )
                    )
                case ("close",):
                    if client is not None:
                        await client.close()
                        client = None
                    gc.collect()
                    conn.send(("ok", None))
                case ("stop",):
                    status = proc_status()
                    conn.send(("ok", {"rss_kib": status.get("VmRSS"), "rss_peak_kib": status.get("VmHWM")}))
                    return
                case _:
                    raise ValueError(f"unknown command {command!r}")
    finally:
        if client is not None:
            await client.close()


# -- the driver -----------------------------------------------------------------------------------


def run_scale(scale: Scale, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    timeout_s = args.timeout_s
    cp_conn, cp_child = ctx.Pipe()
    px_conn, px_child = ctx.Pipe()
    decoders: dict[str, Any] = {}
    if args.compare_decoders:
        console.print(f"[{scale.name}] YAML decoders alone (own process) ...")
        dec_conn, dec_child = ctx.Pipe()
        dec = ctx.Process(target=decoders_entry, args=(dec_child, scale.name), name="decoders")
        dec.start()
        try:
            decoders = call(dec_conn, None, timeout_s * 2)
        finally:
            dec.join(timeout_s)
            if dec.is_alive():
                dec.terminate()
                dec.join(5)
    console.print(
        f"[{scale.name}] the bench's extras: full translation, tracemalloc passes (own process) ..."
    )
    ex_conn, ex_child = ctx.Pipe()
    ex = ctx.Process(target=extras_entry, args=(ex_child, scale.name, args.mode, args.profile), name="extras")
    ex.start()
    try:
        extras = call(ex_conn, None, timeout_s * 2)
    finally:
        ex.join(timeout_s)
        if ex.is_alive():
            ex.terminate()
            ex.join(5)
    cp = ctx.Process(target=control_plane_entry, args=(cp_child, scale.name, args.mode), name="control plane")
    px: multiprocessing.Process | None = None
    try:
        cp.start()
        console.print(f"[{scale.name}] control plane: generating, parsing, translating ...")
        plane = call(cp_conn, None, timeout_s)
        px = ctx.Process(target=proxy_entry, args=(px_child, plane["port"], timeout_s), name="node proxy")
        px.start()
        console.print(f"[{scale.name}] node proxy: initial load over delta ADS ...")
        initial = call(px_conn, ("connect", {"trace": False, "profile": False}), timeout_s)
        incremental = []
        for kind, type_url in (("pod", ADDRESS), ("policy", AUTHORIZATION)):
            for index in range(args.repeats):
                call(px_conn, ("arm",), timeout_s)
                change = call(cp_conn, ("mutate", kind, index), timeout_s)
                seen = call(px_conn, ("await", type_url), timeout_s)
                other = "Authorization" if kind == "pod" else "Address"
                only_changed = seen["pushes"] == [(SHORT[type_url], [change["expected"]], 1, 0)] and change[
                    "resources_queued"
                ] == {SHORT[type_url]: 1, other: 0}
                incremental.append(
                    {
                        "kind": kind,
                        "changed": change["expected"],
                        "store_s": change["store_s"],
                        "translate_s": change["translate_s"],
                        "update_s": change["update_s"],
                        "update_to_applied_s": seen["applied_at"] - change["t_update_start"],
                        "change_to_applied_s": seen["applied_at"] - change["t_start"],
                        "translate_to_applied_s": seen["applied_at"] - change["t_translate_start"],
                        "control_plane_cpu_s": change["control_plane_cpu_s"],
                        "control_plane_cpu_after_store_s": change["control_plane_cpu_after_store_s"],
                        "proxy_decode_s": seen["decode_s"],
                        "proxy_apply_s": seen["apply_s"],
                        "wire_bytes": seen["wire_bytes"],
                        "responses_queued": change["responses_queued"],
                        "resources_queued": change["resources_queued"],
                        "pushes_seen": seen["pushes"],
                        "only_changed_resource_sent": only_changed,
                    }
                )
        call(px_conn, ("close",), timeout_s)
        console.print(f"[{scale.name}] node proxy: initial load again under tracemalloc ...")
        traced_load = call(px_conn, ("connect", {"trace": True, "profile": False}), timeout_s)
        call(px_conn, ("close",), timeout_s)
        profiled = None
        if args.profile:
            profiled = call(px_conn, ("connect", {"trace": False, "profile": True}), timeout_s)
            call(px_conn, ("close",), timeout_s)
        px_final = call(px_conn, ("stop",), timeout_s)
        cp_final = call(cp_conn, ("stop",), timeout_s)
        px.join(timeout_s)
        cp.join(timeout_s)
    finally:
        # Only the two children started above.
        for proc in (px, cp):
            if proc is not None and proc.is_alive():
                proc.terminate()
                proc.join(5)
    proxy = {
        **initial,
        "traced_peak_kib": traced_load["traced_peak_kib"],
        "traced_retained_kib": traced_load["traced_retained_kib"],
        "traced_connect_to_ready_s": traced_load["connect_to_ready_s"],
        "process_rss_peak_kib": px_final["rss_peak_kib"],
    }
    profiles = dict(extras["profiles"])
    stages = {**decoders, **plane["stages"], "translate": extras["stages"]["translate"]}
    for name in ("load", "update"):
        stages[name] = {**stages[name], **extras["stages"][name]}
    if profiled is not None:
        profiles["proxy_initial_load"] = profiled["profile"]
    return {
        "scale": dataclasses.asdict(scale) | {"namespaces": scale.namespaces, "nodes": scale.nodes},
        "control_plane": {
            **plane["summary"],
            "stages": stages,
            "process_rss_peak_kib": cp_final["rss_peak_kib"],
        },
        "node_proxy": proxy,
        "incremental": incremental,
        "profiles": profiles,
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.1f}"


def _mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:,.1f}"


def print_scale(result: dict[str, Any], console: Console) -> None:
    sc = result["scale"]
    cp = result["control_plane"]
    st = cp["stages"]
    title = (
        f"control plane, {sc['pods']:,} pods / {sc['services']:,} services / {sc['policies']:,} "
        f"AuthorizationPolicies ({sc['namespaces']} namespaces, {sc['nodes']} nodes): own process"
    )
    table = Table(title=title, title_justify="left")
    for col in (
        "stage",
        "ms",
        "CPU ms",
        "traced peak MiB",
        "traced held MiB",
        "RSS Δ MiB",
        "RSS peak Δ MiB",
        "detail",
    ):
        table.add_column(col, justify="left" if col in ("stage", "detail") else "right")

    def row(name: str, s: dict[str, Any], detail: str) -> None:
        table.add_row(
            name,
            _ms(s["seconds"]),
            _ms(s.get("cpu_s")),
            _mib(s.get("traced_peak_kib")),
            _mib(s.get("traced_retained_kib")),
            _mib(s["rss_delta_kib"]),
            _mib(s["rss_peak_over_start_kib"]),
            detail,
        )

    row(
        "parse YAML (kube.parse_documents)",
        st["parse"],
        f"{cp['yaml_bytes'] / 2**20:,.1f} MiB, {cp['yaml_documents']:,} documents",
    )
    if "decode_pyyaml" in st:
        row("  decode only, pure-Python PyYAML", st["decode_pyyaml"], "yaml.safe_load_all (own process)")
        row("  decode only, libyaml", st["decode_libyaml"], "yaml.load_all(Loader=CSafeLoader) (own process)")
    row("KubeStore(objects)", st["store"], cp["store"])
    incremental = cp.get("mode") == "incremental"
    row(
        "AmbientIndex.update (start-up)" if incremental else "translate (start-up)",
        st["load"],
        f"{cp['workloads']:,} workloads, {cp['services']:,} services, {cp['authorizations']:,} authorizations",
    )
    sizes = cp["serialized_bytes"]
    row(
        "AdsServer.apply (pack + hash)" if incremental else "AdsServer.update (pack + hash)",
        st["update"],
        f"Address {sizes['Address'] / 2**20:,.1f} MiB, Authorization {sizes['Authorization'] / 2**20:,.2f} MiB",
    )
    row("translate (full, reference)", st["translate"], "what every change cost before the AmbientIndex")
    console.print(table)

    px = result["node_proxy"]
    table = Table(
        title="node proxy: initial load from the real AdsServer over gRPC (own process)", title_justify="left"
    )
    for col in ("measure", "value"):
        table.add_column(col, justify="left" if col == "measure" else "right")
    table.add_row("client start -> ready (ms)", _ms(px["connect_to_ready_s"]))
    table.add_row("  client start -> first response delivered (ms)", _ms(px["connect_to_first_response_s"]))
    table.add_row("  first response -> ready (ms)", _ms(px["first_response_to_ready_s"]))
    table.add_row("  decode, XdsSession.handle_response (ms)", _ms(px["decode_s"]))
    table.add_row("  apply, StateUpdater.apply_push (ms)", _ms(px["apply_s"]))
    for r in px["responses"]:
        table.add_row(
            f"  response {r['type']}: resources / wire MiB",
            f"{r['resources']:,} / {r['wire_bytes'] / 2**20:,.2f}",
        )
    table.add_row(
        "state: workloads / services / policies",
        f"{px['workloads']:,} / {px['services']:,} / {px['policies']:,}",
    )
    table.add_row(
        "RSS Δ / RSS peak Δ over start (MiB)",
        f"{_mib(px['rss_delta_kib'])} / {_mib(px['rss_peak_over_start_kib'])}",
    )
    table.add_row(
        "traced peak / held after ready (MiB, second load)",
        f"{_mib(px['traced_peak_kib'])} / {_mib(px['traced_retained_kib'])}",
    )
    table.add_row(
        "control plane RSS / peak RSS when serving (MiB; parse -> ADS, before the bench's extras)",
        f"{_mib(cp['serving_rss_kib'])} / {_mib(cp['serving_peak_rss_kib'])}",
    )
    table.add_row(
        "process peak RSS, control plane (with the bench's extras) / node proxy (MiB)",
        f"{_mib(cp['process_rss_peak_kib'])} / {_mib(px['process_rss_peak_kib'])}",
    )
    console.print(table)

    title = f"one object changed ({cp.get('mode', 'full')} translation; median of repeats)"
    table = Table(title=title, title_justify="left")
    for col in (
        "change",
        "n",
        "KubeStore ms",
        "translate ms",
        "update ms",
        "update->applied ms",
        "translate->applied ms",
        "change->applied ms",
        "control plane CPU ms",
        "proxy decode+apply ms",
        "wire bytes",
        "only it sent",
    ):
        table.add_column(col, justify="left" if col == "change" else "right")
    for kind in ("pod", "policy"):
        runs = [r for r in result["incremental"] if r["kind"] == kind]
        if not runs:
            continue

        def med(key: str, runs=runs) -> float:
            return statistics.median(r[key] for r in runs)

        table.add_row(
            "pod turns not-ready" if kind == "pod" else "policy principal edited",
            str(len(runs)),
            _ms(med("store_s")),
            _ms(med("translate_s")),
            _ms(med("update_s")),
            _ms(med("update_to_applied_s")),
            _ms(med("translate_to_applied_s")),
            _ms(med("change_to_applied_s")),
            _ms(med("control_plane_cpu_s")),
            _ms(statistics.median(r["proxy_decode_s"] + r["proxy_apply_s"] for r in runs)),
            f"{med('wire_bytes'):,.0f}",
            "yes" if all(r["only_changed_resource_sent"] for r in runs) else "NO",
        )
    console.print(table)
    for name, lines in result["profiles"].items():
        console.print(f"cProfile, {name} (by own time):")
        for line in lines[: PROFILE_TOP + 1]:
            console.print("  " + line, markup=False, highlight=False)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scale",
        choices=(*SCALES, "all"),
        default="all",
        help="1k = 1,000 pods / 100 services / 100 policies; 10k = ten times that",
    )
    parser.add_argument("--repeats", type=int, default=3, help="incremental updates per kind")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="bound on every step")
    parser.add_argument("--profile", action="store_true", help="also cProfile each stage and print the top")
    parser.add_argument(
        "--mode",
        choices=("incremental", "full"),
        default="incremental",
        help="incremental: the AmbientIndex, as ControlPlane.apply does; full: translate everything per "
        "change, as it did before (runs on older trees too)",
    )
    parser.add_argument(
        "--compare-decoders",
        action="store_true",
        help="also time the YAML decode alone, pure-Python PyYAML against libyaml (own process; slow)",
    )
    args = parser.parse_args()

    console = Console(width=160)
    names = list(SCALES) if args.scale == "all" else [args.scale]
    results = {}
    load_before = os.getloadavg()
    for name in names:
        results[name] = run_scale(SCALES[name], args, console)
        print_scale(results[name], console)

    import grpc
    from google.protobuf.internal import api_implementation

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "control_plane",
                "repeats": args.repeats,
                "mode": args.mode,
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "protobuf": api_implementation.Type(),
                "grpcio": grpc.__version__,
                # Other work on the host skews wall times; compare runs made at a similar load.
                "loadavg_1m": {"start": load_before[0], "end": os.getloadavg()[0]},
                "notes": [
                    "control plane and node proxy run in separate processes (multiprocessing, spawn)",
                    "seconds are wall time of one untraced run; traced_* from a second run under tracemalloc",
                    "tracemalloc sees only the Python heap: protobuf (upb) and gRPC core memory show in RSS only",
                    "rss_peak_over_start_kib: VmHWM after a reset via /proc/self/clear_refs, minus VmRSS at the start",
                    "one object changed: a new KubeStore (the directory watcher's snapshot), then translate "
                    "(mode full: everything; mode incremental: AmbientIndex.update of the changed key) "
                    "and the push, as ControlPlane.apply does",
                    "serving_peak_rss_kib: peak RSS after parse -> KubeStore -> translation -> ADS, before "
                    "the bench's reference and traced passes; process_rss_peak_kib: the whole run's peak",
                ],
                "scales": results,
            },
            indent=2,
        )
        + "\n"
    )
    console.print(
        f"load average (1 min) {load_before[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end "
        f"on {os.cpu_count()} CPUs; wrote {RESULTS}"
    )


if __name__ == "__main__":
    main()
