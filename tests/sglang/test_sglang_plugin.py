"""The plugin as SGLang sees it: the flag, the class lookup, KVPoll by name,
SGLang's KVArgs as kvconn memory."""

from __future__ import annotations

import argparse
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from kvpool import Pool


def test_the_flag_and_every_class_resolve_to_kvconn(sglang_with_kvconn: Any) -> None:
    utils = sglang_with_kvconn
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer
    from sglang.srt.server_args import ServerArgs

    from kvconn_sglang.conn import KVConnKVManager, KVConnKVReceiver, KVConnKVSender

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(
        [
            "--model-path",
            "m",
            "--disaggregation-mode",
            "decode",
            "--disaggregation-transfer-backend",
            "kvconn",
        ]
    )
    backend = utils.TransferBackend(args.disaggregation_transfer_backend)
    kinds = utils.KVClassType
    assert utils.get_kv_class(backend, kinds.MANAGER) is KVConnKVManager
    assert utils.get_kv_class(backend, kinds.SENDER) is KVConnKVSender
    assert utils.get_kv_class(backend, kinds.RECEIVER) is KVConnKVReceiver
    assert utils.get_kv_class(backend, kinds.BOOTSTRAP_SERVER) is CommonKVBootstrapServer
    assert KVConnKVManager.supports_deferred_decode_kv_release
    # SGLang's own backends are untouched.
    from sglang.srt.disaggregation.fake import FakeKVSender

    assert utils.get_kv_class(utils.TransferBackend("fake"), kinds.SENDER) is FakeKVSender
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--disaggregation-transfer-backend", "kvconn2"])


def test_kvpoll_translates_by_name_so_sglangs_minimum_over_ranks_stays_right(sglang_with_kvconn: Any) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll as Sglang

    from kvconn.protocol.ledger import KVPoll as Kvconn
    from kvconn_sglang.poll import to_sglang

    assert {s.name: to_sglang(s, Sglang) for s in Kvconn} == {
        "BOOTSTRAPPING": Sglang.Bootstrapping,
        "WAITING_FOR_INPUT": Sglang.WaitingForInput,
        "TRANSFERRING": Sglang.Transferring,
        "SUCCESS": Sglang.Success,
        "FAILED": Sglang.Failed,
    }
    # One failed rank among successful ones: SGLang's minimum must be Failed.
    ranks = [Kvconn.SUCCESS, Kvconn.FAILED, Kvconn.TRANSFERRING]
    assert min(to_sglang(s, Sglang) for s in ranks) == Sglang.Failed


def test_sglangs_kv_pointers_become_registered_buffers_and_a_layout(sglang_with_kvconn: Any) -> None:
    from sglang.srt.disaggregation.base.conn import KVArgs

    from kvconn_sglang.memory import KVArgsError, engine_kv

    pool = Pool(tp_size=2, tp_rank=1, fill=False)
    kv = engine_kv(pool.kv_args(KVArgs), tp_size=2, tp_rank=1, is_mla=False)
    assert [(b.address, b.nbytes) for b in kv.buffers] == [(a.ctypes.data, a.nbytes) for a in pool.arrays]
    assert kv.layout.tp_size == 2 and kv.layout.tp_rank == 1
    assert [p.page_bytes for p in kv.layout.buffers] == [a[0].nbytes for a in pool.arrays]
    assert {p.order for p in kv.layout.buffers} == {"NHD"}
    assert kv.layout.num_pages == pool.arrays[0].shape[0]

    broken = pool.kv_args(KVArgs)
    broken.kv_item_lens = broken.kv_item_lens[:-1]
    with pytest.raises(KVArgsError, match="one length"):
        engine_kv(broken, 2, 1, is_mla=False)
    odd = pool.kv_args(KVArgs)
    odd.kv_item_lens = [n + 1 for n in odd.kv_item_lens]
    with pytest.raises(KVArgsError, match="tokens x"):
        engine_kv(odd, 2, 1, is_mla=False)


def test_decode_kv_args_without_a_head_count_take_the_models(sglang_with_kvconn: Any, tmp_path: Any) -> None:
    """SGLang 0.5.23's decode builds the manager before it sets
    ``kv_head_num`` (and sets it only with heterogeneous-TP staging on): the
    manager reads the model's KV heads, as a real decode server needs."""
    from kvpool import TOTAL_HEADS
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.server_args import ServerArgs
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=TOTAL_HEADS,
        num_key_value_heads=TOTAL_HEADS,
        head_dim=16,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(tmp_path)
    server_args = ServerArgs(model_path=str(tmp_path), skip_tokenizer_init=True, device="cpu")
    pool = Pool(tp_size=1, tp_rank=0, fill=False)
    args = pool.kv_args(KVArgs)
    del args.kv_head_num  # as SGLang's decode hands it
    manager = sglang_with_kvconn.get_kv_class(
        sglang_with_kvconn.TransferBackend("kvconn"), sglang_with_kvconn.KVClassType.MANAGER
    )(args, sglang_with_kvconn.DisaggregationMode.DECODE, server_args)
    try:
        assert {p.heads for p in manager.engine_kv.layout.buffers} == {TOTAL_HEADS}
    finally:
        manager.close()


def test_a_receiver_whose_bootstrap_server_does_not_answer_fails_with_the_reason(
    sglang_with_kvconn: Any, caplog: pytest.LogCaptureFixture
) -> None:
    utils = sglang_with_kvconn
    from sglang.srt.disaggregation.base.conn import KVArgs

    import kvconn
    import kvconn_sglang
    from kvconn.testing.cluster import free_port
    from kvconn_sglang.conn import KVConnKVManager, KVConnKVReceiver

    pool = Pool(1, 0, fill=False)
    with caplog.at_level(logging.INFO, logger="kvconn_sglang.conn"):
        manager = KVConnKVManager(
            pool.kv_args(KVArgs),
            utils.DisaggregationMode.DECODE,
            SimpleNamespace(tp_size=1, enable_dp_attention=False),
        )
    # The versions an operator reports: the adapter's and the core's (issue 43).
    assert f"kvconn-sglang {kvconn_sglang.__version__} (kvconn-core {kvconn.__version__})" in caplog.text
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there
    try:
        assert not manager.try_ensure_parallel_info(nowhere)  # SGLang's queue retries, then aborts
        rx = KVConnKVReceiver(manager, nowhere, 5)
        rx.init(0)
        assert rx.poll() == utils.KVPoll.Failed
        with pytest.raises(RuntimeError, match=f"bootstrap server {nowhere}"):
            rx.failure_exception()
        # Nothing was asked of any prefill: nothing is held, SGLang may free at once.
        rx.ensure_abort_notified(force_arm=True)
        assert not rx.abort_notified
        assert manager.is_abort_release_safe(5, 1)
    finally:
        manager.close()


def test_settings_refuse_what_they_cannot_use() -> None:
    from kvconn_sglang.settings import Settings, SettingsError

    s = Settings.from_env({"KVCONN_SGLANG_ABORT_TIMEOUT_S": "40", "KVCONN_SGLANG_BACKEND_OPTIONS": "a=1,b=2"})
    assert s.config.abort_timeout_s == 40 and dict(s.config.backend_options) == {"a": "1", "b": "2"}
    with pytest.raises(SettingsError, match="ABORT_TIMEOUT_S"):
        Settings.from_env({"KVCONN_SGLANG_ABORT_TIMEOUT_S": "soon"})
    with pytest.raises(SettingsError, match="MEMORY"):
        Settings.from_env({"KVCONN_SGLANG_MEMORY": "hbm"})


def test_sglangs_own_bootstrap_and_waiting_deadlines_bound_both_halves_of_a_request() -> None:
    """Issue 40, finding 3: a prefill request whose decode never asks ended
    only when its client hung up; it now fails at SGLang's bootstrap
    timeout, as with SGLang's own backends, and a decode request never
    filled at SGLang's waiting timeout."""
    from kvconn_sglang.settings import Settings, SettingsError

    default = Settings.from_env({}).config
    assert (default.room_bootstrap_timeout_s, default.transfer_timeout_s) == (300, 300)
    env = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "45", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "90"}
    config = Settings.from_env(env).config
    assert (config.room_bootstrap_timeout_s, config.transfer_timeout_s) == (45, 90)
    # kvconn's own variables override them (off included)
    env |= {"KVCONN_SGLANG_ROOM_BOOTSTRAP_TIMEOUT_S": "20", "KVCONN_SGLANG_TRANSFER_TIMEOUT_S": "none"}
    config = Settings.from_env(env).config
    assert (config.room_bootstrap_timeout_s, config.transfer_timeout_s) == (20, None)
    with pytest.raises(SettingsError, match="SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"):
        Settings.from_env({"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "0"})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a=1,=2", r"KVCONN_SGLANG_BACKEND_OPTIONS wants KEY=VALUE, got '=2'"),
        ("a=1, a=2", r"KVCONN_SGLANG_BACKEND_OPTIONS: 'a' given twice \(a='1' and a='2'\)"),
    ],
)
def test_backend_options_follow_kvconns_key_value_rule(text: str, message: str) -> None:
    from kvconn_sglang.settings import Settings, SettingsError

    assert dict(
        Settings.from_env({"KVCONN_SGLANG_BACKEND_OPTIONS": " u = x=y ,"}).config.backend_options
    ) == {"u": "x=y"}
    with pytest.raises(SettingsError, match=message):
        Settings.from_env({"KVCONN_SGLANG_BACKEND_OPTIONS": text})


def test_sglangs_shutdown_request_is_hooked_and_the_drain_ends_before_sglangs_sigkill(
    sglang_with_kvconn: Any,
) -> None:
    from sglang.srt.managers import tokenizer_manager
    from sglang.srt.managers.io_struct import ShutdownReq
    from sglang.srt.managers.scheduler import Scheduler

    from kvconn_sglang import shutdown
    from kvconn_sglang.settings import Settings

    # The SIGKILL the budget is counted from is the installed SGLang's.
    assert tokenizer_manager._SCHEDULER_EXIT_TIMEOUT_SECS == shutdown.SGLANG_SCHEDULER_EXIT_S
    assert Scheduler.handle_shutdown.__wrapped__ is not None  # the plugin's AROUND hook, applied

    def budget(**env: str) -> tuple[float, float]:
        return shutdown.budget(Settings.from_env({f"KVCONN_SGLANG_{k}": v for k, v in env.items()}))

    # The limit: 3 s before SGLang's SIGKILL; the grace leaves the writes in flight their deadline + 1 s.
    assert budget(WRITE_TIMEOUT_S="5", DRAIN_GRACE_S="10") == (6.0, 12.0)
    assert budget(WRITE_TIMEOUT_S="5", DRAIN_GRACE_S="2") == (2.0, 12.0)
    assert budget(WRITE_TIMEOUT_S="20", DRAIN_GRACE_S="10") == (0.0, 12.0)
    # A scheduler whose KV manager is not kvconn's stops at once, as without the plugin.
    other = SimpleNamespace(
        disagg_prefill_bootstrap_queue=SimpleNamespace(kv_manager=object()), gracefully_exit=False
    )
    Scheduler.handle_shutdown(other, ShutdownReq())
    assert other.gracefully_exit
