"""Where the tests' files are, independent of where a test module sits."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS_DATA = ROOT / "tests" / "data"
# Golden files of the unit tier: rendered output compared byte for byte, rewritten by UPDATE_GOLDEN=1.
UNIT_GOLDEN = ROOT / "tests" / "unit" / "golden"
