"""The short fault run CI keeps (``kvconn-vllm-faults``, docs/comparison.md):
vLLM's NixlConnector and kvconn on four real engines, through one fault:
decode frozen as its connector is handed a request's KV load, past
prefill's lease, while a later request is prefilled.

Fails if kvconn's row shows a corrupted block or a hung request. The
NixlConnector row is checked too, the other way: there prefill frees its
blocks at the lease's expiry, the later request takes them, and decode's
read returns its bytes (vLLM #47021); a run that does not see that has a
blind block watch, and proves nothing about kvconn's row.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import NEEDS_VLLM

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytest.importorskip("kvconn_vllm", reason=NEEDS_VLLM)

from kvconn_vllm.faults import cli

pytestmark = pytest.mark.timeout(900)


def test_kvconn_row_clean_where_nixlconnector_reads_reused_blocks(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    code = cli.main(
        [
            "--connector", "NixlConnector",
            "--connector", "kvconn:loopback",
            "--faults", "decode_frozen",
            "--happy", "",
            "--no-plain",
            "--warmup", "1",
            "--lease-s", "4",
            "--json", str(out),
            "--require-clean", "kvconn",
        ]
    )  # fmt: skip
    rows = {row["connector"]: row for row in json.loads(out.read_text())["faults"]}
    kvconn, nixl = rows["kvconn (loopback)"], rows["NixlConnector (pull)"]
    assert kvconn["requests"], kvconn["notes"]
    assert (kvconn["corrupted"], kvconn["hung"]) == (0, 0), kvconn
    assert [r["outcome"] for r in kvconn["requests"]] == ["answered"], kvconn
    assert code == 0
    assert nixl["corrupted"] >= 1, f"the watch saw no read of reused blocks: {nixl}"
