"""Interop tests run in-process on uvloop, as the programs do (the integration tier's factory)."""

from tests.integration.conftest import pytest_asyncio_loop_factories  # noqa: F401
