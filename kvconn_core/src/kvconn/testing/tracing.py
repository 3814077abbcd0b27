"""Spans in memory, for tests: this process's tracer provider becomes an
SDK one with the SDK's in-memory exporter (needs ``opentelemetry-sdk``).

OpenTelemetry takes a process's provider once: the first call installs it,
later ones return the same exporter. A rank process of
:class:`kvconn.testing.cluster.Cluster` with ``tracing`` installs it at
start and answers ``spans`` on stdin with :func:`finished_spans`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from kvconn.runtime.trace_export import OsRandomIds, span_record

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
        provider = TracerProvider(id_generator=cast(Any, OsRandomIds()))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        _exporter = exporter
    return _exporter


def finished_spans() -> list[dict[str, Any]]:
    """Every span this process finished, as plain data."""
    return [span_record(s) for s in memory_exporter().get_finished_spans()]


def _events(span: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [e for e in span["events"] if e["name"] == name]


def order_errors(spans: Sequence[dict[str, Any]]) -> list[str]:
    """What is out of order in one room's trace (records as
    :func:`kvconn.runtime.trace_export.span_record` makes them, from every
    process on one host: one wall clock); empty when it is whole and in order:

    * one root, ``kvconn.room``, and every other span its child;
    * no child starts before the root or ends after it, except a rank's
      answers to ABORTs of a room it had acked already (decode re-sends
      ABORTs, each with a new generation, while a room is held; a rank that
      resumes from a stop answers every copy, and decode releases on the
      first ack before the rank reads the rest);
    * each ack decode took (``kvconn.ack`` event, ``taken``) has the rank's
      ``kvconn.rank.ack`` span (same rank and generation), started no later;
    * each ``kvconn.abort_received`` at a rank comes no earlier than decode's
      ``kvconn.abort_sent`` of that generation;
    * the root's events: the abort, then its sends, then the acks, then the release.
    """
    errors: list[str] = []
    roots = [s for s in spans if s["parent_id"] is None]
    if len(roots) != 1 or roots[0]["name"] != "kvconn.room":
        return [f"want one root kvconn.room span, got {[(s['name'], s['parent_id']) for s in roots]}"]
    (root,) = roots
    children = [s for s in spans if s is not root]
    first_acks: dict[Any, int] = {}  # rank -> when its first ack of the room started
    for s in children:
        if s["name"] == "kvconn.rank.ack":
            rank = s["attributes"]["kvconn.rank"]
            first_acks[rank] = min(first_acks.get(rank, s["start_ns"]), s["start_ns"])

    def repeat(s: dict[str, Any]) -> bool:
        if s["name"] not in ("kvconn.rank.abort", "kvconn.rank.ack"):
            return False
        first = first_acks.get(s["attributes"]["kvconn.rank"])
        return first is not None and first < s["start_ns"] and first <= root["end_ns"]

    for s in children:
        if s["parent_id"] != root["span_id"] or s["trace_id"] != root["trace_id"]:
            errors.append(f"{s['name']} (pid {s['pid']}) is not a child of the room's root span")
        if s["start_ns"] < root["start_ns"]:
            errors.append(
                f"{s['name']} starts {(root['start_ns'] - s['start_ns']) / 1e6:.3f} ms before the root"
            )
        if s["end_ns"] > root["end_ns"] and not repeat(s):
            errors.append(f"{s['name']} ends {(s['end_ns'] - root['end_ns']) / 1e6:.3f} ms after the root")
    acks = {
        (s["attributes"]["kvconn.rank"], s["attributes"]["kvconn.generation"]): s
        for s in children
        if s["name"] == "kvconn.rank.ack"
    }
    for event in _events(root, "kvconn.ack"):
        a = event["attributes"]
        if a.get("kvconn.result") != "taken":
            continue
        span = acks.get((a["kvconn.rank"], a["kvconn.generation"]))
        if span is None:
            errors.append(
                f"decode took rank {a['kvconn.rank']}'s ack {a['kvconn.generation']}: no rank span for it"
            )
        elif span["start_ns"] > event["time_ns"]:
            late = (span["start_ns"] - event["time_ns"]) / 1e6
            errors.append(
                f"rank {a['kvconn.rank']}'s kvconn.rank.ack starts {late:.3f} ms after decode took it"
            )
    sent = {
        (e["attributes"]["kvconn.rank"], e["attributes"]["kvconn.generation"]): e["time_ns"]
        for e in _events(root, "kvconn.abort_sent")
    }
    for s in children:
        for event in _events(s, "kvconn.abort_received"):
            key = (s["attributes"]["kvconn.rank"], event["attributes"]["kvconn.generation"])
            if key in sent and event["time_ns"] < sent[key]:
                errors.append(f"rank {key[0]} received abort {key[1]} before decode sent it")
    order = ["kvconn.abort", "kvconn.abort_sent", "kvconn.ack", "kvconn.release"]
    firsts: dict[str, int] = {}
    for t, name in sorted((e["time_ns"], e["name"]) for e in root["events"] if e["name"] in order):
        firsts.setdefault(name, t)
    for before, after in itertools.pairwise(order):
        if before in firsts and after in firsts and firsts[after] < firsts[before]:
            errors.append(f"the root's first {after} event comes before its first {before}")
    return errors


__all__ = ["finished_spans", "memory_exporter", "order_errors"]
