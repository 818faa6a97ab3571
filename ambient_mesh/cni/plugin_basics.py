"""What the CNI plugin's executable knows before it loads anything else: where the node agent
listens, the bound on the config it reads, whether a netns is its own. Only `os` is imported:
plugin_handoff.py starts from here, and so do the whole plugin and the agent."""

from __future__ import annotations

import os

DEFAULT_CNI_AGENT_RUN_DIR = "/var/run/istio-cni"
# ours: istio-cni's Go plugin decides by itself and needs no such socket
PLUGIN_RUN_SOCKET_NAME = "pluginrun.sock"
# A network config with its prevResult is a few KiB; a megabyte is not a config.
MAX_PLUGIN_STDIN_BYTES = 1024 * 1024
# The variables a run hands over: the CNI protocol's own (CNI_COMMAND, CNI_NETNS, ...).
DELEGATED_ENV_PREFIX = "CNI_"


def netns_is_own(path: str) -> bool:
    """Whether `path` is the network namespace this process runs in (skel refuses that: the
    agent would put redirection rules on the host)."""
    try:
        target = os.stat(path)
        own = os.stat("/proc/self/ns/net")
    except OSError:
        return False
    return (target.st_dev, target.st_ino) == (own.st_dev, own.st_ino)
