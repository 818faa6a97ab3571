"""Fakes for the node agent's dataplane: the netns locator, packet marker, probes and ztunnel, and
a runner that records the order of host commands."""

from __future__ import annotations

import os

from ambient_mesh.cni.netns_discovery import (
    NetnsCandidate,
)
from ambient_mesh.cni.podinfo import PodInfo
from ambient_mesh.cni.pods import WatchedPod
from ambient_mesh.host.commands import RecordingRunner


def pod(
    name="web",
    uid="uid-1",
    ns="demo",
    ips=("10.0.0.5",),
    labels=None,
    annotations=None,
    phase="Running",
    **kw,
) -> WatchedPod:
    return WatchedPod(
        info=PodInfo(
            name=name,
            namespace=ns,
            uid=uid,
            ips=tuple(ips),
            labels=labels or {},
            annotations=annotations or {},
            **kw,
        ),
        service_account="sa-web",
        phase=phase,
    )


class FakeProbeSet:
    def __init__(self, log):
        self.members: dict = {}
        self.log = log
        self.fail = False

    def ensure(self):
        self.log.append(("probe", "ensure"))

    def entries(self):
        return dict(self.members)

    def upsert(self, ip, uid):
        if self.fail:
            raise OSError("netlink says no")
        self.log.append(("probe", "upsert", str(ip), uid))
        self.members[ip] = uid

    def delete(self, ip):
        self.log.append(("probe", "delete", str(ip)))
        self.members.pop(ip, None)

    def flush(self):
        self.members.clear()

    def destroy(self):
        self.log.append(("probe", "destroy"))
        self.members.clear()


class FakeZtunnel:
    def __init__(self, log):
        self.log = log
        self.error: str | None = None
        self.del_error: str | None = None

    async def add_workload(self, uid, info, netns_fd):
        os.fstat(netns_fd)  # must still be open
        self.log.append(("ztunnel", "add", uid, str(info)))
        return self.error

    async def del_workload(self, uid):
        self.log.append(("ztunnel", "del", uid))
        return self.del_error


class FakeMarker:
    def __init__(self, log):
        self.log = log
        self.marks: dict[str, str] = {}

    async def mark_enrolled(self, pod, value="enabled"):
        self.log.append(("mark", value, pod.uid))
        self.marks[pod.uid] = value

    async def unmark(self, pod):
        self.log.append(("unmark", pod.uid))
        self.marks.pop(pod.uid, None)


class FakeLocator:
    def __init__(self, paths: dict[str, str]):
        self.paths = paths
        self.asked: list[dict] = []

    def find(self, wanted):
        self.asked.append(dict(wanted))
        return {
            uid: NetnsCandidate(pid=1, path=self.paths[uid], dev=0, inode=0, starttime=0)
            for uid in wanted
            if uid in self.paths
        }


class OrderedRunner:
    """A RecordingRunner that also notes rule writes in the harness's shared step log."""

    def __init__(self, log):
        self.recording = RecordingRunner()
        self.log = log

    @property
    def calls(self):
        return self.recording.calls

    def respond(self, *args, **kwargs):
        self.recording.respond(*args, **kwargs)

    def run(self, argv, *, input=None, netns=None, check=True):
        if argv[0] in ("iptables-restore", "nft"):
            self.log.append(("rules", argv[0]))
        return self.recording.run(argv, input=input, netns=netns, check=check)
