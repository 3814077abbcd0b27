"""A decode scheduler process as SGLang runs one with ``--enable-metrics``:
``PROMETHEUS_MULTIPROC_DIR`` set by the parent (SGLang's launcher sets it,
``set_prometheus_multiproc_dir``, before it starts its schedulers), the
kvconn plugin loaded, and kvconn_sglang's decode manager built as SGLang's
decode builds it, with ``server_args.enable_metrics``. Its prefill is a
kvconn rank process of its own (:mod:`kvconn.testing.prefill_proc`, not an
SGLang process: it writes no metrics files).

It aborts one room mid-bootstrap (released by proof), prints
``{"ready": true}``, then waits for stdin to close.
Run as ``python tests/sglang/metrics_decode_child.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import standins

standins.install()

from kvpool import Pool  # noqa: E402
from sglang.srt.disaggregation import utils  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402

from kvconn.testing.waiting import wait_for  # noqa: E402

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def main() -> None:
    assert os.environ.get(MULTIPROC_ENV), "the parent sets the multiprocess folder"
    load_plugins()
    backend = utils.TransferBackend("kvconn")
    pool = Pool(1, 0, fill=False)
    # no aux rows: the rank below has no extras buffers to match SGLang's
    args = pool.kv_args(utils.get_kv_class(backend, utils.KVClassType.KVARGS))
    server_args = SimpleNamespace(tp_size=1, enable_dp_attention=False, enable_metrics=True)
    manager_class = utils.get_kv_class(backend, utils.KVClassType.MANAGER)
    manager = manager_class(args, utils.DisaggregationMode.DECODE, server_args)
    env = {k: v for k, v in os.environ.items() if k != MULTIPROC_ENV}  # prefill: another engine
    # the pool's geometry (kvpool.py), so that the rank can write decode's pages
    engine = {"layers": 2, "pages": 16, "tokens": 4, "heads": 4, "head_bytes": 8, "order": "NHD"}
    rank_args = {"backend": "loopback", "rank": 0, "num_ranks": 1, "engine": engine, "write_timeout_s": 1.0}
    rank = subprocess.Popen(
        [sys.executable, "-m", "kvconn.testing.prefill_proc", json.dumps(rank_args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert rank.stdout is not None and rank.stdin is not None
    try:
        address = json.loads(rank.stdout.readline())["address"]
        rx = manager.endpoint.receiver(1, (0, 1), prefill=[address])
        rx.abort()
        wait_for(lambda: manager.endpoint.held_pages() == 0, 30, "room 1's release", poll=0.002)
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.read()
    finally:
        manager.close()
        rank.stdin.close()
        rank.wait(15)


if __name__ == "__main__":
    main()
