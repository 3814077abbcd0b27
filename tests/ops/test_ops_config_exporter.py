"""Config.metrics_port: an endpoint built with it serves its metrics over HTTP
(a decode endpoint and its rank in one process share the port), and closing
the endpoints stops the server."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvconn.config import Config
from kvconn.metrics import ENDPOINT_LABEL
from kvconn.protocol.ledger import KVPoll
from kvconn.runtime.decode import DecodeEndpoint
from kvconn.runtime.prefill import PrefillRank
from kvconn.testing.null import NullBackend


def test_endpoints_configured_with_a_metrics_port_serve_their_metrics() -> None:
    backend = NullBackend()
    config = Config(metrics_port=0)
    rank = PrefillRank(backend, 0, 16 * 4096, config)
    decode = DecodeEndpoint(backend, 16, 4096, [rank.address], config)
    try:
        assert rank.metrics_server is not None and decode.metrics_server is not None
        assert rank.metrics_server.port == decode.metrics_server.port  # one port per process
        rx = decode.receiver(1, (0, 1))
        sender = rank.sender(1)
        deadline = time.monotonic() + 10
        while sender.poll() < KVPoll.WAITING_FOR_INPUT:
            assert time.monotonic() < deadline, "the request never reached the rank"
            time.sleep(0.001)
        sender.send([0, 1], last=True)
        while rx.poll() is not KVPoll.SUCCESS:
            assert time.monotonic() < deadline, "the room never succeeded"
            time.sleep(0.001)
        url = decode.metrics_server.url
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        (chunks,) = [f for f in text_string_to_metric_families(text) if f.name == "kvconn_chunks"]
        landed = {
            s.labels[ENDPOINT_LABEL]: s.value for s in chunks.samples if s.labels["outcome"] == "landed"
        }
        assert landed == {"prefill-0": 1.0, "decode": 0.0}
    finally:
        decode.close()
        rank.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)


def test_without_a_metrics_port_nothing_is_served() -> None:
    rank = PrefillRank(NullBackend(), 0, 4096, Config())
    try:
        assert rank.metrics_server is None
    finally:
        rank.close()


def test_a_metrics_port_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="metrics_port"):
        Config(metrics_port=70000)
