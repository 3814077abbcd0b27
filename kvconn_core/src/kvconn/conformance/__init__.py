"""kvconn's transport conformance suite.

Run it as ``kvconn conformance BACKEND [--strict] [--thorough] [--watch S]
[-k EXPR]``, or from a plugin's own tests::

    from kvconn.conformance import ConformanceSuite

    class TestMyTransport(ConformanceSuite):
        backend_name = "mytransport"

The fixtures and options come from :mod:`kvconn.conformance.plugin`, which
kvconn-core registers as a pytest plugin (``pytest11`` entry point).

Checks that a write did *not* land after some answer (a fence, a
FAILED_SETTLED, a release after the writer's exit) hold the transport two
ways: a writer process freezes itself right after the answer, so nothing
of it moves while the suite checks and lays fresh canaries; and the pages
are then watched for ``--watch`` seconds (2; 10 with ``--strict`` or
``--thorough``) for what runs outside it, and guarded on to the end of the
run (the last check, ``test_nothing_landed_late_in_the_whole_run``). A
rank's exit counts as proof only if nothing it started outlives it (its
session, and the orphans re-parented to the suite, a child subreaper; none
may still map decode's memory once the rank died). The plugin's regions,
engine buffers included, live in a harness process: a stray write that
crashes it fails a check, naming the signal, instead of the suite.
"""

from __future__ import annotations

from kvconn.conformance.harness import ConformanceFailure, Settings
from kvconn.conformance.plugin import require_capability
from kvconn.conformance.suite import ConformanceSuite

__all__ = ["ConformanceFailure", "ConformanceSuite", "Settings", "require_capability"]
