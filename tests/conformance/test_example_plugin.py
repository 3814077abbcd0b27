"""The tutorial's example plugin (examples/kvconn-tcpdemo) passes the suite."""

from __future__ import annotations

import pytest

from kvconn.conformance import ConformanceSuite
from kvconn.plugins import BackendError, get_backend

try:
    get_backend("tcpdemo")
except BackendError as exc:  # pragma: no cover - the example is not installed
    pytest.skip(f"pip install -e examples/kvconn-tcpdemo first: {exc}", allow_module_level=True)


class TestTcpdemoConformance(ConformanceSuite):
    backend_name = "tcpdemo"
