"""kvconn_vllm.faults.connectors: what each connector of a fault run is
configured with (no engine)."""

from __future__ import annotations

import pytest

from kvconn_vllm.faults.connectors import BUILTIN, ConnectorError, Ports, parse, parse_extra

PORTS = Ports(prefill=41000, decode=42000)


def test_vllms_nixl_connectors_get_the_short_lease_and_their_ports_by_role() -> None:
    pull, push = parse("NixlConnector", lease_s=4), parse("NixlPushConnector", lease_s=4)
    assert (pull.direction, push.direction) == ("pull", "push")
    config = pull.transfer_config("kv_producer", PORTS)
    assert config["kv_connector"] == "NixlConnector" and "kv_connector_module_path" not in config
    assert config["kv_buffer_device"] == "cpu" and config["kv_load_failure_policy"] == "recompute"
    assert config["kv_connector_extra_config"] == {"kv_lease_duration": 4}
    # The push connector's decode watchdog is its own setting (480 s by default).
    assert push.transfer_config("kv_consumer", PORTS)["kv_connector_extra_config"] == {
        "kv_lease_duration": 4,
        "push_registration_timeout": 4,
    }
    assert pull.env("kv_producer", PORTS)["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "41000"
    assert pull.env("kv_consumer", PORTS)["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "42000"


def test_kvconn_prefill_listens_on_the_pairs_fixed_port_and_decode_on_none() -> None:
    kvconn = parse("kvconn:nixl", lease_s=5)
    producer = kvconn.transfer_config("kv_producer", PORTS)["kv_connector_extra_config"]
    consumer = kvconn.transfer_config("kv_consumer", PORTS)["kv_connector_extra_config"]
    assert (producer["backend"], producer["port"], producer["transfer_timeout_s"]) == ("nixl", 41000, 5.0)
    assert "port" not in consumer
    assert kvconn.env("kv_producer", PORTS) == {}
    # Every key is one kvconn_vllm's own settings parser takes.
    from kvconn_vllm.settings import Settings

    Settings.parse(producer)


def test_any_connector_by_class_and_module_with_extra_settings() -> None:
    other = parse("MyConnector@my.module", parse_extra(['lease=3', "mode=fast"]))
    config = other.transfer_config("kv_consumer", PORTS)
    assert (config["kv_connector"], config["kv_connector_module_path"]) == ("MyConnector", "my.module")
    assert config["kv_connector_extra_config"] == {"lease": 3, "mode": "fast"}
    for bad in ("NoModule", "@x", "1bad@mod"):
        with pytest.raises(ConnectorError):
            parse(bad)
    with pytest.raises(ConnectorError):
        parse_extra(["novalue"])
    assert set(BUILTIN) >= {"NixlConnector", "NixlPushConnector"}
