"""`python -m ambient_mesh.workers <channel fd> <index> <loads fd>`: one worker process (started by the owner)."""

import sys

from .worker import main

sys.exit(main(sys.argv[1:]))
