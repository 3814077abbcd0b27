"""The suite itself, run against the embedded loopback transport: all pass."""

from __future__ import annotations

from kvconn.conformance import ConformanceSuite


class TestLoopbackConformance(ConformanceSuite):
    backend_name = "loopback"
