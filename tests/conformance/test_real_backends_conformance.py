"""The suite against the two real transports, where they are installed
(scripts/test.sh installs both; a machine without them skips, saying why)."""

from __future__ import annotations

from typing import ClassVar

import pytest

from kvconn.conformance import ConformanceSuite
from kvconn.plugins import BackendError, get_backend


def _installed(name: str) -> bool:
    try:
        get_backend(name)
    except BackendError:
        return False
    return True


@pytest.mark.skipif(not _installed("nixl"), reason="kvconn-nixl (and nixl) not installed")
class TestNixlConformance(ConformanceSuite):
    backend_name = "nixl"


@pytest.mark.skipif(not _installed("mooncake"), reason="kvconn-mooncake (and its engine) not installed")
class TestMooncakeConformance(ConformanceSuite):
    backend_name = "mooncake"


@pytest.mark.skipif(not _installed("nixl"), reason="kvconn-nixl (and nixl) not installed")
class TestNixlCmaConformance(ConformanceSuite):
    """UCX's own choice (cma on one host): no fence claimed, the rest holds."""

    backend_name = "nixl"
    backend_options: ClassVar[dict[str, str]] = {"ucx_tls": "default"}
