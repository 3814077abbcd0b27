"""Put on PYTHONPATH of a real SGLang server on a CPU-only host to run
SGLang's own transfer backends (``mooncake``, ``nixl``) as well as kvconn's
(scripts/compare_sglang.py; docs/comparison.md):

* the test harness's stand-ins, as ``cpu_site`` installs them;
* two CPU facts told to SGLang's own backends, nothing of their transfer
  logic changed: its Mooncake sender does not take host-tensor page
  indices (prefill.py's path for it pins memory and records a CUDA event:
  ``RuntimeError: pin_memory=True requires a CUDA or other accelerator
  backend``); its NIXL KV manager registers the KV pool as ``DRAM``, which
  it is here (SGLang labels every device pool ``VRAM``, and UCX without
  CUDA refuses that: ``VRAM memory is detected as host by UCX ...
  registration cannot proceed``);
* with ``KVCONN_PAGE_WATCH=<prefix>``, a page watch in each scheduler: a
  KV slot freed to the allocator is filled with a canary, checked every
  50 ms while free and once more when allocated again; a changed canary is
  a write that landed after the slot was freed. Also the slots in use, over
  time. Written as JSON lines to ``<prefix>-<pid>.jsonl``.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import standins

standins.install()

CANARY = 12345.5


def _mooncake(module: Any) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


def _nixl(module: Any) -> None:
    init = module.NixlKVManager.__init__

    def __init__(self: Any, args: Any, *rest: Any, **kw: Any) -> None:
        args.kv_data_mem_kinds = ["DRAM"] * len(args.kv_data_ptrs)
        init(self, args, *rest, **kw)

    module.NixlKVManager.__init__ = __init__


class _Watch:
    """One allocator's freed slots, watched (see the module docstring)."""

    def __init__(self, allocator: Any, path: str) -> None:
        self.allocator = allocator
        self.out = open(path, "a", buffering=1)  # noqa: SIM115 (closed with the process)
        self.lock = threading.RLock()
        self.watched: dict[int, float] = {}
        self.last_used = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvconn-page-watch", daemon=True)
        self._thread.start()
        # A daemon thread still in a torch call as the interpreter finalizes
        # aborts the process ("terminate called without an active exception").
        atexit.register(self.close)

    def close(self) -> None:
        """Stop the watch's thread (at the latest at exit)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _buffers(self) -> list[Any]:
        kv = self.allocator.get_kvcache()
        return [*(getattr(kv, "k_buffer", None) or []), *(getattr(kv, "v_buffer", None) or [])]

    def _emit(self, **event: Any) -> None:
        self.out.write(json.dumps({"t": time.monotonic(), **event}) + "\n")

    def freed(self, index: Any) -> None:
        slots = [int(i) for i in index.tolist()]
        with self.lock:
            for buf in self._buffers():
                buf[index] = CANARY
            now = time.monotonic()
            for slot in slots:
                self.watched[slot] = now

    def allocated(self, index: Any) -> None:
        if index is None:
            return
        with self.lock:
            slots = [int(i) for i in index.tolist() if int(i) in self.watched]
            if slots:
                self._check(slots, "realloc")
                for slot in slots:
                    self.watched.pop(slot, None)

    def _check(self, slots: list[int], when: str) -> None:
        import torch

        index = torch.tensor(slots, dtype=torch.long)
        changed = torch.zeros(len(slots), dtype=torch.bool)
        for buf in self._buffers():
            changed |= (buf.index_select(0, index) != CANARY).reshape(len(slots), -1).any(dim=1)
        bad = [s for s, c in zip(slots, changed.tolist(), strict=True) if c]
        if bad:
            self._emit(
                kind="late_write", slots=len(bad), when=when, freed_at=min(self.watched[s] for s in bad)
            )
            for buf in self._buffers():
                buf[torch.tensor(bad, dtype=torch.long)] = CANARY

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            try:
                with self.lock:
                    if self.watched:
                        self._check(list(self.watched), "free")
                    size = self.allocator.available_size
                    free = size() if callable(size) else size
                    used = int(self.allocator.size) - int(free)
                if used != self.last_used:
                    self.last_used = used
                    self._emit(kind="used", used=used)
            except Exception as exc:  # the watch must never take the scheduler down
                self._emit(kind="watch_error", error=repr(exc))


def _allocator(module: Any) -> None:
    prefix = os.environ.get("KVCONN_PAGE_WATCH")
    if not prefix:
        return
    cls = module.TokenToKVPoolAllocator
    init, free, alloc = cls.__init__, cls.free, cls.alloc

    def __init__(self: Any, *args: Any, **kw: Any) -> None:
        init(self, *args, **kw)
        self._kvconn_watch = _Watch(self, f"{prefix}-{os.getpid()}.jsonl")

    def watched_free(self: Any, free_index: Any) -> None:
        deferred = self.free_group is not None
        free(self, free_index)
        watch = getattr(self, "_kvconn_watch", None)
        if watch is not None and not deferred and free_index.numel():
            watch.freed(free_index)

    def watched_alloc(self: Any, need_size: int) -> Any:
        out = alloc(self, need_size)
        watch = getattr(self, "_kvconn_watch", None)
        if watch is not None:
            watch.allocated(out)
        return out

    cls.__init__, cls.free, cls.alloc = __init__, watched_free, watched_alloc


_PATCHES = {
    "sglang.srt.disaggregation.mooncake.conn": _mooncake,
    "sglang.srt.disaggregation.nixl.conn": _nixl,
    "sglang.srt.mem_cache.allocator.token": _allocator,
}


class _Hook(importlib.abc.MetaPathFinder):
    """Applies a patch right after its module is first imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _Hook())
