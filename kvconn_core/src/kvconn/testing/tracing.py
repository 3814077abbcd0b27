"""Spans in memory, for tests: this process's tracer provider becomes an
SDK one with the SDK's in-memory exporter (needs ``opentelemetry-sdk``).

OpenTelemetry takes a process's provider once: the first call installs it,
later ones return the same exporter. A rank process of
:class:`kvconn.testing.cluster.Cluster` with ``tracing`` installs it at
start and answers ``spans`` on stdin with :func:`finished_spans`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvconn.runtime.trace_export import span_record

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_exporter: InMemorySpanExporter | None = None


def memory_exporter() -> InMemorySpanExporter:
    """The in-memory exporter every span of this process goes to."""
    global _exporter
    if _exporter is None:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        _exporter = exporter
    return _exporter


def finished_spans() -> list[dict[str, Any]]:
    """Every span this process finished, as plain data."""
    return [span_record(s) for s in memory_exporter().get_finished_spans()]


__all__ = ["finished_spans", "memory_exporter"]
