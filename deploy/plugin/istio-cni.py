"""Entry script of the packaged CNI plugin: scripts/cluster/plugin.sh freezes it with PyInstaller
into one executable the node agent copies into the host's CNI bin dir as `istio-cni`.
plugin_handoff hands each run to the node agent and loads the rest of the plugin only when the
agent does not answer."""

import sys

from ambient_mesh.cni.plugin_handoff import main

sys.exit(main())
