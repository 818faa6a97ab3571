"""`python -m ambient_mesh`: the `ambient` command."""

import sys

from .cli import main

sys.exit(main())
