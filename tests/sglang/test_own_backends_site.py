"""tests/sglang/own_backends_site: the page watch it puts in an SGLang
scheduler (scripts/compare_sglang.py), on a stand-in allocator over torch
tensors laid out as SGLang's MHA pool (one row per token slot)."""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

SITE = Path(__file__).resolve().parent / "own_backends_site" / "sitecustomize.py"


def _site() -> Any:
    spec = importlib.util.spec_from_file_location("own_backends_sitecustomize", SITE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Pool:
    def __init__(self) -> None:
        self.k_buffer = [torch.rand(17, 2, 4) for _ in range(2)]
        self.v_buffer = [torch.rand(17, 2, 4) for _ in range(2)]


class _Allocator:
    size = 16

    def __init__(self) -> None:
        self.pool = _Pool()
        self.free_count = 16

    def get_kvcache(self) -> _Pool:
        return self.pool

    def available_size(self) -> int:
        return self.free_count


@pytest.fixture
def watches() -> Iterator[list[Any]]:
    """The watches a test made, stopped after it: a watch's thread still in a
    torch call as the interpreter finalizes aborts pytest."""
    made: list[Any] = []
    yield made
    for watch in made:
        watch.close()


def _events(path: Path, kind: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        events = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        found = [e for e in events if e["kind"] == kind]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_a_write_into_a_freed_slot_is_reported(tmp_path: Path, watches: list[Any]) -> None:
    site = _site()
    allocator = _Allocator()
    path = tmp_path / "watch.jsonl"
    watch = site._Watch(allocator, str(path))
    watches.append(watch)
    watch.freed(torch.tensor([3, 4]))
    assert bool((allocator.pool.v_buffer[1][4] == site.CANARY).all())
    time.sleep(0.2)
    assert _events(path, "late_write", 0.1) == []
    allocator.pool.k_buffer[0][4, 1, 2] = 0.25  # lands after the free
    (late,) = _events(path, "late_write")
    assert (late["slots"], late["when"]) == (1, "free")


def test_a_write_before_reuse_is_reported_at_allocation_and_the_slot_unwatched(
    tmp_path: Path, watches: list[Any]
) -> None:
    site = _site()
    allocator = _Allocator()
    path = tmp_path / "watch.jsonl"
    watch = site._Watch(allocator, str(path))
    watches.append(watch)
    with watch.lock:  # no check of the loop's in between
        watch.freed(torch.tensor([7]))
        allocator.pool.v_buffer[0][7, 0, 0] = 1.0
        watch.allocated(torch.tensor([7, 8]))
    assert [(e["slots"], e["when"]) for e in _events(path, "late_write")] == [(1, "realloc")]
    assert watch.watched == {}


def test_slots_in_use_are_reported_as_they_change(tmp_path: Path, watches: list[Any]) -> None:
    site = _site()
    allocator = _Allocator()
    path = tmp_path / "watch.jsonl"
    watches.append(site._Watch(allocator, str(path)))
    allocator.free_count = 10
    deadline = time.monotonic() + 10
    while [e["used"] for e in _events(path, "used")][-1:] != [6] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [e["used"] for e in _events(path, "used")][-1] == 6
