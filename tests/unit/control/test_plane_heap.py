"""`ambient control`'s heap after its first load (plane.py `freeze_loaded_state`)."""

from __future__ import annotations

import gc

from ambient_mesh.control.plane import freeze_loaded_state


def test_the_loaded_state_leaves_the_collectors_walk():
    gc.unfreeze()
    kept = [[i] for i in range(1000)]  # long-lived containers, tracked by the collector
    try:
        assert gc.get_freeze_count() == 0
        freeze_loaded_state()
        assert gc.get_freeze_count() >= len(kept)
        # Not walked by a full collection any more: the objects are in the permanent generation.
        assert all(gc.is_tracked(o) for o in kept)
        assert not any(o is kept[0] for o in gc.get_objects(generation=2))
    finally:
        gc.unfreeze()
