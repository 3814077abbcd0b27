"""The suite against the two real transports, where they are installed
(scripts/test.sh installs both; a machine without them skips, saying why)."""

from __future__ import annotations

from typing import ClassVar

import pytest

from kvconn.conformance import ConformanceSuite
from kvconn.testing.libraries import why_unavailable

# By the library, not the entry point: the plugins install without it.
NIXL_MISSING = why_unavailable("nixl")
MOONCAKE_MISSING = why_unavailable("mooncake")


@pytest.mark.skipif(NIXL_MISSING is not None, reason=str(NIXL_MISSING))
class TestNixlConformance(ConformanceSuite):
    backend_name = "nixl"


@pytest.mark.skipif(MOONCAKE_MISSING is not None, reason=str(MOONCAKE_MISSING))
class TestMooncakeConformance(ConformanceSuite):
    backend_name = "mooncake"


@pytest.mark.slow  # a third full run (2 minutes on 2 cores); nixl's default runs above
@pytest.mark.skipif(NIXL_MISSING is not None, reason=str(NIXL_MISSING))
class TestNixlCmaConformance(ConformanceSuite):
    """UCX's own choice (cma on one host): no fence claimed, the rest holds."""

    backend_name = "nixl"
    backend_options: ClassVar[dict[str, str]] = {"ucx_tls": "default"}
