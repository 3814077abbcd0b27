"""kvconn.metrics.serve_metrics / export: a real endpoint's figures scraped
over HTTP, as Prometheus would, from another process."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from ops_support import EndpointChild
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvconn.metrics import ENDPOINT_LABEL, Metrics, export, serve_metrics


def scrape(port: int) -> dict[str, list[Sample]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        assert family.name not in out, f"family {family.name} appears twice in one scrape"
        out[family.name] = list(family.samples)
    return out


def value(families: dict[str, list[Sample]], family: str, sample: str, **labels: str) -> float:
    found = [s.value for s in families[family] if s.name == sample and s.labels == labels]
    assert len(found) == 1, f"{sample}{labels}: {len(found)} samples"
    return found[0]


def test_a_running_endpoint_and_its_rank_are_scraped_on_one_port(endpoint_child: EndpointChild) -> None:
    families = scrape(endpoint_child.port)
    dec, pre = {ENDPOINT_LABEL: "decode"}, {ENDPOINT_LABEL: "prefill-0"}
    # the rank wrote the 3 pages of room 1; decode saw them land and released room 2 with proof
    assert value(families, "kvconn_chunks", "kvconn_chunks_total", outcome="landed", **pre) == 3.0
    assert value(families, "kvconn_chunks", "kvconn_chunks_total", outcome="landed", **dec) == 0.0
    releases = {
        s.labels["proof"]: s.value
        for s in families["kvconn_releases"]
        if s.name.endswith("_total") and s.labels[ENDPOINT_LABEL] == "decode" and s.value
    }
    assert releases.keys() in ({"acks"}, {"completed"}, {"nothing_sent"}) and sum(releases.values()) == 1.0
    (proof,) = releases
    assert value(families, "kvconn_released_pages", "kvconn_released_pages_total", proof=proof, **dec) == 2.0
    assert (
        value(
            families,
            "kvconn_abort_to_release_seconds",
            "kvconn_abort_to_release_seconds_count",
            proof=proof,
            **dec,
        )
        == 1.0
    )
    assert value(families, "kvconn_pages_held", "kvconn_pages_held", **dec) == 0.0
    assert (
        value(families, "kvconn_quarantine_oldest_seconds", "kvconn_quarantine_oldest_seconds", **dec) == 0.0
    )
    # every sample names its endpoint: the two registries' series never collide
    # (a labelled family nothing has counted yet, e.g. drops by reason, has no samples)
    for name, samples in families.items():
        assert all(s.labels.get(ENDPOINT_LABEL) in ("decode", "prefill-0") for s in samples), name
    assert {s.labels[ENDPOINT_LABEL] for s in families["kvconn_pages_held"]} == {"decode", "prefill-0"}


def test_every_family_of_a_registry_is_served() -> None:
    """Nothing is lost in the merge: the scrape has each family Metrics() registers, with its type."""
    m = Metrics("decode")
    expected = {f.name: f.type for f in m.registry.collect()}
    with serve_metrics(m) as server:
        families = {
            f.name: f.type
            for f in text_string_to_metric_families(
                urllib.request.urlopen(server.url, timeout=10).read().decode()
            )
        }
    assert {k: families.get(k) for k in expected} == expected
    # the text format gives unlabelled counters' creation times families of their own
    assert all(k.endswith("_created") for k in families.keys() - expected.keys())


def test_close_frees_the_port() -> None:
    server = serve_metrics({"decode": Metrics("decode")})
    port = server.port
    assert port > 0
    scrape(port)
    server.close()
    server.close()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    with socket.socket() as s:  # and the port can be bound again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_a_name_served_twice_is_refused() -> None:
    with serve_metrics({"decode": Metrics("decode")}) as server, pytest.raises(ValueError, match="decode"):
        server.add("decode", Metrics("decode").registry)


def test_endpoints_of_one_process_share_an_exporter_until_the_last_leaves() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    a, b = Metrics("decode"), Metrics("decode")
    a.pages_held.set(5)
    b.pages_held.set(7)
    stop_a = export(a, "decode", port)
    stop_b = export(b, "decode", port)  # same name in one process: made unique
    assert (stop_a.name, stop_b.name, stop_a.port, stop_b.port) == ("decode", "decode-2", port, port)
    held = {s.labels[ENDPOINT_LABEL]: s.value for s in scrape(port)["kvconn_pages_held"]}
    assert held == {"decode": 5.0, "decode-2": 7.0}
    stop_a.close()
    stop_a.close()  # idempotent: must not take b's name or the server down
    assert {s.labels[ENDPOINT_LABEL] for s in scrape(port)["kvconn_pages_held"]} == {"decode-2"}
    stop_b.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_counters_alerts_watch_start_at_zero_for_every_known_label() -> None:
    """Prometheus's increase() cannot see a series' first sample as an event:
    the children alert rules use exist at 0 before anything is counted."""
    m = Metrics("decode")
    for proof in (
        "acks",
        "late_acks",
        "writer_fence",
        "writer_exit",
        "completed",
        "nothing_sent",
        "unsafe_timeout",
    ):
        assert m.registry.get_sample_value("kvconn_releases_total", {"proof": proof}) == 0.0
        assert m.registry.get_sample_value("kvconn_released_pages_total", {"proof": proof}) == 0.0
    for result in ("ok", "failed"):
        assert m.registry.get_sample_value("kvconn_fences_total", {"result": result}) == 0.0
    for proof in ("acks", "owner_fence", "unsafe_timeout"):  # and abort-to-release, empty
        assert m.registry.get_sample_value("kvconn_abort_to_release_seconds_count", {"proof": proof}) == 0.0
    # a prefill rank's: from its bootstrap, before it can be found down
    m.known_rank(3, "tcp://10.0.0.7:17000")
    for cause in ("exited", "silent"):
        labels = {"cause": cause, "rank": "3", "address": "tcp://10.0.0.7:17000"}
        assert m.registry.get_sample_value("kvconn_ranks_down_total", labels) == 0.0
