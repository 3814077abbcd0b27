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


def test_tutorial_plugin_refuses_options_it_does_not_take() -> None:
    from kvconn.options import OptionError
    from kvconn.transport import capabilities_of

    backend = get_backend("tcpdemo")
    for open_ in (backend.open_region, backend.open_writer):
        with pytest.raises(OptionError, match="unknown tcpdemo option 'piece_bytes'; tcpdemo options: none"):
            open_(4096, {"piece_bytes": "1"})
    with pytest.raises(OptionError):
        capabilities_of(backend, {"piece_bytes": "1"})  # what the core asks first
