"""scripts/compare_sglang.py: how a fault row's requests are judged (no
server: a stand-in pair answers the page watch)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compare_sglang.py"


def load_script() -> Any:
    spec = importlib.util.spec_from_file_location("compare_sglang", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("compare_sglang", module)
    spec.loader.exec_module(module)
    return module


class StandInPair:
    prefill = "prefill-server"
    decode = "decode-server"

    def label(self) -> str:
        return "SGLang stand-in"

    def watch(self, server: object) -> list[dict[str, Any]]:
        return []


def test_a_request_killed_with_decode_keeps_that_outcome() -> None:
    compare = load_script()
    run = compare.Run(StandInPair(), reference=None, lease_s=6, aborts=1)
    row = run._begin("decode_killed")
    # What decode_killed leaves: the request was posted to both servers,
    # decode was killed under it, its decode post dropped.
    row["requests"].append({"rid": "dkilled-1", "ids": [3, 4], "reference": [5], "client_abort": False})
    row["requests"][0]["outcome"] = "killed with decode"
    finished = run._finish(row)
    assert [r["outcome"] for r in finished["requests"]] == ["killed with decode"]
    assert (finished["hung"], finished["failed"]) == (0, 0)


def test_a_request_never_posted_to_decode_is_not_sent() -> None:
    compare = load_script()
    run = compare.Run(StandInPair(), reference=None, lease_s=6, aborts=1)
    row = run._begin("abort")
    row["requests"].append({"rid": "abort-1", "ids": [3, 4], "reference": [5], "client_abort": False})
    assert [r["outcome"] for r in run._finish(row)["requests"]] == ["not sent"]
