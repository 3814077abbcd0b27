"""Spans as JSON lines: what ``kvconn bench --trace FILE`` writes, and how a
test's child process hands its spans back (needs ``opentelemetry-sdk``, in
the ``kvconn-core[trace]`` extra).

One line per finished span: ``name``, ``trace_id`` (32 hex digits),
``span_id`` and ``parent_id`` (16; ``parent_id`` null for a root),
``start_ns`` and ``end_ns`` (Unix epoch nanoseconds), ``attributes``,
``events`` (``name``, ``time_ns``, ``attributes``), ``links`` (their
``trace_id`` and ``span_id``) and ``pid``, the process that recorded it.
Processes may share the file: each line is one ``write`` to a file opened
for appending, so lines never interleave.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExportResult


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """``span`` as the plain data of one JSON line (the module's docstring)."""
    ctx = span.context
    assert ctx is not None  # a finished SDK span has one
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": None if span.parent is None else f"{span.parent.span_id:016x}",
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": _plain(span.attributes),
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": _plain(e.attributes)} for e in span.events
        ],
        "links": [
            {"trace_id": f"{ln.context.trace_id:032x}", "span_id": f"{ln.context.span_id:016x}"}
            for ln in span.links
        ],
        "pid": os.getpid(),
    }


def _plain(attributes: Any) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (attributes or {}).items()}


class JsonLinesExporter:
    """An OpenTelemetry SDK span exporter appending :func:`span_record` lines to ``path``."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from opentelemetry.sdk.trace.export import SpanExportResult

        with self._lock:
            if self._fd < 0:
                return SpanExportResult.FAILURE
            for span in spans:
                os.write(self._fd, (json.dumps(span_record(span)) + "\n").encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class OsRandomIds:
    """Trace and span ids from the OS's randomness, for the providers kvconn
    makes. The SDK's default draws them from Python's ``random``, which
    engines seed (vLLM seeds every worker with 0): its decode and prefill
    processes drew the same ids, a rank's span carried its parent's span id,
    and each restart repeated the first trace ids. (An IdGenerator by duck
    type, as the exporter below.)"""

    def generate_span_id(self) -> int:
        return secrets.randbits(64) or 1  # 0 is the invalid id

    def generate_trace_id(self) -> int:
        return secrets.randbits(128) or 1

    def is_trace_id_random(self) -> bool:
        return True  # all 128 bits are random (W3C Trace Context level 2)


def write_spans_to(path: str) -> TracerProvider:
    """Make this process's tracer provider an SDK one that appends every
    finished span to ``path`` (at once: kvconn ends a few spans per room),
    and return it (``shutdown()`` it before exit). For a process that sets
    up no OpenTelemetry of its own, as the bench's."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(id_generator=cast(Any, OsRandomIds()))
    # An exporter by duck type: subclassing the SDK's would import it with kvconn.
    provider.add_span_processor(SimpleSpanProcessor(cast(Any, JsonLinesExporter(path))))
    trace.set_tracer_provider(provider)
    return provider


_file_providers: dict[str, TracerProvider] = {}
_file_lock = threading.Lock()


def trace_to_file(path: str) -> TracerProvider:
    """:func:`write_spans_to` once per process and path (an engine builds
    one connector or KV manager per role and rank, and OpenTelemetry takes
    one provider per process): what an engine adapter calls for its
    ``trace_file`` setting. Raises :class:`ImportError` naming the extra
    when ``opentelemetry-sdk`` is missing, so a configured trace file never
    silently records nothing."""
    with _file_lock:
        provider = _file_providers.get(path)
        if provider is None:
            try:
                provider = _add_file(path)
            except ImportError as exc:
                raise ImportError(
                    f"a trace file needs opentelemetry-sdk: pip install 'kvconn-core[trace]' ({exc})"
                ) from exc
            _file_providers[path] = provider
        return provider


def _add_file(path: str) -> TracerProvider:
    """The file's exporter on the process's SDK provider if the engine set
    one up (its spans keep going where they went), else on a new one."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    current = trace.get_tracer_provider()
    if not isinstance(current, TracerProvider):
        return write_spans_to(path)
    current.add_span_processor(SimpleSpanProcessor(cast(Any, JsonLinesExporter(path))))
    return current


def read_spans(path: str) -> list[dict[str, Any]]:
    """The records of a file :class:`JsonLinesExporter` wrote."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


__all__ = ["JsonLinesExporter", "OsRandomIds", "read_spans", "span_record", "trace_to_file", "write_spans_to"]
