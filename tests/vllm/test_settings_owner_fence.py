"""The owner fence reaches kvconn's Config through kv_connector_extra_config
(off unless set); Config's own checks refuse a bad value. Pure: runs
without vLLM."""

from __future__ import annotations

import pytest

from kvconn_vllm.settings import Settings, SettingsError


def test_the_owner_fence_is_off_unless_set() -> None:
    assert Settings.parse(None).config.owner_fence_after_s is None


def test_the_owner_fence_options_reach_kvconns_config() -> None:
    config = Settings.parse({"owner_fence_after_s": "30", "owner_fence_min_interval_s": 120}).config
    assert (config.owner_fence_after_s, config.owner_fence_min_interval_s) == (30.0, 120.0)


@pytest.mark.parametrize("extra", [{"owner_fence_after_s": -1}, {"owner_fence_min_interval_s": 0}])
def test_a_bad_owner_fence_value_is_refused(extra: dict[str, float]) -> None:
    with pytest.raises(SettingsError, match="owner_fence"):
        Settings.parse(extra)
