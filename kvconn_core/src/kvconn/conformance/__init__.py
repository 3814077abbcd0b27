"""kvconn's transport conformance suite.

Run it as ``kvconn conformance BACKEND [--strict] [-k EXPR]``, or from a
plugin's own tests::

    from kvconn.conformance import ConformanceSuite

    class TestMyTransport(ConformanceSuite):
        backend_name = "mytransport"

The fixtures and options come from :mod:`kvconn.conformance.plugin`, which
kvconn-core registers as a pytest plugin (``pytest11`` entry point).
"""

from __future__ import annotations

from kvconn.conformance.harness import ConformanceFailure, Settings
from kvconn.conformance.plugin import require_capability
from kvconn.conformance.suite import ConformanceSuite

__all__ = ["ConformanceFailure", "ConformanceSuite", "Settings", "require_capability"]
