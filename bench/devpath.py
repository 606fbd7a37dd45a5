"""Puts the repository's dev-only test doubles (``testing/sharegpu_testing``: the fake API
server, the replay, TLS material; never in the wheel or the image) on ``sys.path`` for the
benchmarks that drive them. Import it before ``sharegpu_testing``."""

from __future__ import annotations

import sys
from pathlib import Path

TESTING = Path(__file__).resolve().parent.parent / "testing"
if str(TESTING) not in sys.path:
    sys.path.insert(0, str(TESTING))
