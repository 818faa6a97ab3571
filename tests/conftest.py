"""Settings shared by every tier.

Hypothesis runs without its per-example deadline: a deadline is a timed assertion, and on a
shared, loaded 2-core host one example of an unchanged test took five times the default 200 ms.
Speed is measured by the scripts under bench/, never by the suite."""

from hypothesis import settings

import ambient_mesh  # noqa: F401 - first, so that its process settings precede any gRPC import

settings.register_profile("ambient-mesh", deadline=None)
settings.load_profile("ambient-mesh")
