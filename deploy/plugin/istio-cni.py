"""Entry script of the packaged CNI plugin (scripts/cluster/plugin.sh freezes it with PyInstaller
into one executable the node agent copies into the host's CNI bin dir as `istio-cni`)."""

import sys

from ambient_mesh.cni.plugin import main

sys.exit(main())
