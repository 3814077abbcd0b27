"""What ``kvconn conformance`` hands to pytest: the suite, backend from the option."""

from __future__ import annotations

from kvconn.conformance.suite import ConformanceSuite


class TestConformance(ConformanceSuite):
    pass
