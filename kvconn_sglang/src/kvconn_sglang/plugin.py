"""Registers kvconn with SGLang through its general plugin hooks.

SGLang has no transfer-backend registry: ``TransferBackend`` is a closed
Enum and ``get_kv_class`` an if/elif. Its plugin loader (entry-point group
``sglang.srt.plugins``, run in every SGLang process before ``ServerArgs`` is
parsed) is enough:

- REPLACE ``utils.TransferBackend`` with the same Enum plus ``KVCONN``;
- AROUND ``get_kv_class``: kvconn's classes for ``kvconn``, SGLang's otherwise;
- ``add_disagg_transfer_backend_choices(["kvconn"])`` for the CLI flag;
- AROUND ``DecodeTransferQueue.__init__`` and ``_defer_release``: with kvconn,
  an aborted room is always held (whatever
  ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE`` says) and SGLang's
  own deadline (``..._DEFERRED_DECODE_KV_RELEASE_TIMEOUT``) never frees it:
  only kvconn's release does, through ``is_abort_release_safe``;
- AROUND ``Scheduler.handle_shutdown`` (SGLang's ShutdownReq, how it stops a
  server): a scheduler with kvconn's KV manager drains it first, its event
  loop stepping meanwhile (:mod:`kvconn_sglang.shutdown`).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable
from typing import Any

from kvconn_sglang import BACKEND_NAME
from kvconn_sglang.shutdown import TARGET as SHUTDOWN_HANDLER
from kvconn_sglang.shutdown import around_handle_shutdown

log = logging.getLogger(__name__)

UTILS = "sglang.srt.disaggregation.utils"
DECODE_QUEUE = "sglang.srt.disaggregation.decode.DecodeTransferQueue"


def extended_transfer_backend(original: type[enum.Enum]) -> type[enum.Enum]:
    """SGLang's TransferBackend with a ``KVCONN`` member added."""
    members = {m.name: m.value for m in original}
    if BACKEND_NAME in members.values():
        return original
    members["KVCONN"] = BACKEND_NAME
    extended = enum.Enum(original.__name__, members, module=original.__module__)  # type: ignore[misc]
    extended.__qualname__ = original.__qualname__
    return extended


def kv_class_for(class_type: Any) -> type | None:
    """kvconn's class for SGLang's ``KVClassType`` member ``class_type``."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

    from kvconn_sglang.conn import KVConnKVManager, KVConnKVReceiver, KVConnKVSender

    mapping: dict[str, type] = {
        "kvargs": KVArgs,
        "manager": KVConnKVManager,
        "sender": KVConnKVSender,
        "receiver": KVConnKVReceiver,
        # SGLang's own bootstrap server: prefill still registers with it, and
        # the router still hands decode its address.
        "bootstrap_server": CommonKVBootstrapServer,
    }
    return mapping.get(str(getattr(class_type, "value", class_type)))


def around_get_kv_class(original: Callable[..., Any], transfer_backend: Any, class_type: Any) -> Any:
    if getattr(transfer_backend, "value", transfer_backend) == BACKEND_NAME:
        return kv_class_for(class_type)
    return original(transfer_backend, class_type)


def _is_kvconn_receiver(receiver: object) -> bool:
    from kvconn_sglang.conn import KVConnKVReceiver

    return isinstance(receiver, KVConnKVReceiver)


def around_decode_queue_init(original: Callable[..., Any], queue: Any, *args: Any, **kwargs: Any) -> None:
    original(queue, *args, **kwargs)
    # The same view of the configuration the queue itself was built from.
    from sglang.srt.disaggregation import decode

    if (
        decode.get_disagg().disaggregation_transfer_backend == BACKEND_NAME
        and not queue.enable_deferred_kv_release
    ):
        log.info("kvconn: aborted rooms are held until released (deferred decode KV release is on)")
        queue.enable_deferred_kv_release = True


def around_defer_release(original: Callable[..., Any], queue: Any, decode_req: Any) -> None:
    original(queue, decode_req)
    if not _is_kvconn_receiver(decode_req.kv_receiver):
        return
    # SGLang frees a held room at its deadline; kvconn releases it only with
    # proof (and quarantines it meanwhile), so the deadline is removed.
    entry = queue._deferred_releases[-1]
    if entry[0] is decode_req:
        queue._deferred_releases[-1] = (entry[0], entry[1], math.inf, *entry[3:])


def register() -> None:
    """The ``sglang.srt.plugins`` entry point."""
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND_NAME])
    HookRegistry.register(
        f"{UTILS}.TransferBackend", extended_transfer_backend(utils.TransferBackend), HookType.REPLACE
    )
    HookRegistry.register(f"{UTILS}.get_kv_class", around_get_kv_class, HookType.AROUND)
    HookRegistry.register(f"{DECODE_QUEUE}.__init__", around_decode_queue_init, HookType.AROUND)
    HookRegistry.register(f"{DECODE_QUEUE}._defer_release", around_defer_release, HookType.AROUND)
    HookRegistry.register(SHUTDOWN_HANDLER, around_handle_shutdown, HookType.AROUND)


__all__ = ["extended_transfer_backend", "kv_class_for", "register"]
