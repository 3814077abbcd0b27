"""Every misuse of a decode endpoint raises a :class:`~kvconn.errors.KvconnError`
subclass that is also the builtin an engine caught before, and changes
nothing; the writer-deadline rule is the core's, one predicate both sides use."""

from __future__ import annotations

import pytest
from endpoint_world import endpoint

from kvconn.buffers import buffers_of
from kvconn.config import Config, check_deadlines
from kvconn.errors import ArgumentError, ArgumentTypeError, DeadlineError, KvconnError, RequestError
from kvconn.layout import KVLayout, LayoutError
from kvconn.protocol.write_deadline import check_writer_deadline, writer_gives_up_first
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.testing.null import NullBackend
from kvconn.transport import Capabilities, EngineMemoryUnsupported


class _SlowWriter(NullBackend):
    """A transport that may take 40 s to fail a write."""

    capabilities = Capabilities(writer_fence=True, max_write_timeout_s=40.0)


def _layout() -> KVLayout:
    return KVLayout.uniform([4 * 4096], 4, tokens=16, heads=4, head_bytes=64)


def test_the_writer_deadline_rule_is_one_predicate() -> None:
    assert writer_gives_up_first(5.0, 30.0)
    assert not writer_gives_up_first(30.0, 30.0) and not writer_gives_up_first(31.0, 30.0)
    with pytest.raises(DeadlineError, match=r"my deadline \(30.0 s\) must be shorter"):
        check_writer_deadline(30.0, 30.0, "my deadline")
    assert check_deadlines is check_writer_deadline  # what kvconn.config's callers import


def test_a_config_whose_writer_outlasts_decode_is_refused_typed() -> None:
    with pytest.raises(DeadlineError) as info:
        Config(write_timeout_s=40.0, abort_timeout_s=30.0)
    assert isinstance(info.value, ValueError)  # what it raised before


def test_a_decode_over_a_transport_slower_to_fail_than_its_abort_deadline_is_refused_typed() -> None:
    with pytest.raises(DeadlineError, match="null's write timeout") as info:
        DecodeEndpoint(_SlowWriter(), 4, 4096, config=Config(abort_timeout_s=30.0))
    assert isinstance(info.value, ValueError) and "must be shorter than decode's abort_timeout_s" in str(
        info.value
    )
    DecodeEndpoint(_SlowWriter(), 4, 4096, config=Config(abort_timeout_s=41.0)).close()  # longer: fine


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"buffers": [bytearray(4 * 4096)]}, "go together"),
        ({"layout": "set below"}, "go together"),
        (
            {"num_pages": 4, "page_bytes": 4096, "buffers": [bytearray(4 * 4096)], "layout": "set below"},
            "either",
        ),
        ({"num_pages": 4}, "needs num_pages and page_bytes"),
    ],
)
def test_a_decode_constructed_with_arguments_that_do_not_fit_is_refused_typed(
    kwargs: dict[str, object], match: str
) -> None:
    if kwargs.get("layout") == "set below":
        kwargs["layout"] = _layout()
    with pytest.raises(ArgumentError, match=match) as info:
        DecodeEndpoint(NullBackend(), **kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)


def test_engine_memory_that_does_not_fit_its_layout_or_backend_is_refused_typed() -> None:
    with pytest.raises(LayoutError) as layout:
        DecodeEndpoint(NullBackend(), buffers=[bytearray(3 * 4096)], layout=_layout())
    with pytest.raises(ArgumentTypeError) as memory:
        DecodeEndpoint(NullBackend(), buffers=[memoryview(bytes(4 * 4096))], layout=_layout())  # read-only
    assert isinstance(layout.value, KvconnError) and isinstance(layout.value, ValueError)
    assert isinstance(memory.value, KvconnError) and isinstance(memory.value, TypeError)
    assert issubclass(EngineMemoryUnsupported, KvconnError) and issubclass(EngineMemoryUnsupported, TypeError)
    with pytest.raises(ArgumentError, match="at least one buffer"):
        buffers_of([])


def test_a_session_asked_of_a_rank_the_instance_lacks_is_refused_typed() -> None:
    state = endpoint((("p0", "p1"),))
    assert state.session_of(1) == 1
    for rank in (2, -1):
        with pytest.raises(RequestError, match=f"no rank {rank} in a prefill instance of 2 ranks"):
            state.session_of(rank)
