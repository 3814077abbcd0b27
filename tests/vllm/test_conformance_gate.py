"""With ``"conformance": true``, a worker refuses a transport that fails
kvconn's conformance suite before vLLM registers any KV memory with it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from conftest import NEEDS_VLLM

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytest.importorskip("kvconn_vllm", reason=NEEDS_VLLM)

from kvconn_vllm.conformance import TransportRefused
from kvconn_vllm.layout import KVGeometry
from kvconn_vllm.settings import Settings
from kvconn_vllm.worker import WorkerSide

GEOMETRY = KVGeometry(num_blocks=16, block_size=32, num_kv_heads=2, head_size=64)


def worker(**extra: object) -> WorkerSide:
    settings = Settings.parse({"backend": "loopback", "conformance": True, **extra})
    return WorkerSide(settings, producer=True, consumer=True, geometry=GEOMETRY)


@pytest.fixture
def liars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test-only ``liar-*`` transports, findable here and in the suite's process."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "conformance" / "liars"))
    from kvconn_liars.registry import liar_path

    path = liar_path(tmp_path)
    monkeypatch.setenv("PYTHONPATH", path)
    for entry in reversed(path.split(os.pathsep)):
        monkeypatch.syspath_prepend(entry)


def test_a_lying_transport_is_refused_before_use(liars: None) -> None:
    # liar-loopback's early_done: the DONE barrier says "landed" before the bytes are.
    with pytest.raises(TransportRefused, match="failed kvconn conformance") as refused:
        worker(backend="liar-loopback", backend_options={"early_done": "1"})
    assert "test_done_barrier_means_landed" in str(refused.value) or "FAILED" in str(refused.value)


@pytest.mark.slow
def test_an_honest_transport_is_accepted() -> None:
    assert worker().backend.name == "loopback"


def test_conformance_flag_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="conformance must be true or false"):
        Settings.parse({"conformance": "yes"})
