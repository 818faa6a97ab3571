"""Host plumbing: running commands and wiring network namespaces.

Counterparts: istio-cni's command `Dependencies` and ztunnel's namespaced test harness.
"""

from .commands import (
    CommandError,
    CommandRunner,
    CompletedCommand,
    RecordedCall,
    RecordingRunner,
    SubprocessRunner,
)
from .netns import (
    Fabric,
    Node,
    cleanup_stale_namespaces,
    create_netns,
    delete_netns,
    entered,
    list_netns,
    netns_socket,
    spawn_in_netns,
    stop_process,
    wait_for_listen,
)

__all__ = [
    "CommandError",
    "CommandRunner",
    "CompletedCommand",
    "Fabric",
    "Node",
    "RecordedCall",
    "RecordingRunner",
    "SubprocessRunner",
    "cleanup_stale_namespaces",
    "create_netns",
    "delete_netns",
    "entered",
    "list_netns",
    "netns_socket",
    "spawn_in_netns",
    "stop_process",
    "wait_for_listen",
]
