"""The worker-side half alone, prefill and decode in one process over CPU
torch tensors shaped like vLLM's CPU KV cache, through real kvconn
endpoints on the loopback transport (no engine: a test plays the
scheduler). Clocks are injected where a deadline matters."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch (the vLLM venv has it)")

import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402

import attrs  # noqa: E402

from kvconn.testing.cluster import at_the_same_address, free_port  # noqa: E402
from kvconn.testing.waiting import wait_for  # noqa: E402
from kvconn_vllm.layout import KVGeometry  # noqa: E402
from kvconn_vllm.metadata import KvconnMetadata, Recv, Send  # noqa: E402
from kvconn_vllm.settings import Settings  # noqa: E402
from kvconn_vllm.worker import TransferResults, WorkerSide  # noqa: E402

GEOMETRY = KVGeometry(num_blocks=8, block_size=32, num_kv_heads=2, head_size=64)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def kv_caches(fill: float) -> dict[str, torch.Tensor]:
    g = GEOMETRY
    caches = {}
    for layer in range(2):
        t = torch.zeros(g.num_blocks, g.num_kv_heads, 2 * g.block_size, g.head_size)
        for b in range(g.num_blocks):
            t[b].fill_(fill + 100 * layer + b)
        caches[f"model.layers.{layer}.attn"] = t
    return caches


def side(
    producer: bool, clock: Clock, fill: float, **extra: object
) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    settings = Settings.parse({"write_timeout_s": 1, "abort_timeout_s": 2, **extra})
    worker = WorkerSide(settings, producer=producer, consumer=not producer, geometry=GEOMETRY, clock=clock)
    caches = kv_caches(fill)
    worker.register(caches)
    return worker, caches


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def pair(
    clock: Clock,
) -> Iterator[tuple[WorkerSide, WorkerSide, dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    prefill, src = side(True, clock, 1.0, unrequested_timeout_s=5)
    decode, dst = side(False, clock, -1.0, transfer_timeout_s=5)
    try:
        yield prefill, decode, src, dst
    finally:
        decode.close()
        prefill.close()


def until(
    worker: WorkerSide, done: Callable[[TransferResults], bool], finished: set[str] = frozenset()
) -> TransferResults:  # type: ignore[assignment]
    """What the worker reported, summed over its reports, once ``done`` says so."""
    seen = [TransferResults()]

    def report() -> bool:
        r, s = worker.results(finished), seen[0]
        seen[0] = TransferResults(
            s.finished_sending | r.finished_sending,
            s.finished_recving | r.finished_recving,
            s.failed_recving | r.failed_recving,
        )
        return done(seen[0])

    try:
        wait_for(report, 20, "the worker's results", poll=0.01)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {seen[0]}") from None
    return seen[0]


def test_blocks_arrive_byte_for_byte(pair: tuple) -> None:  # type: ignore[type-arg]
    prefill, decode, src, dst = pair
    prefill.start(KvconnMetadata(sends=[Send("p-1", 77, (5, 2, 3))]))
    decode.start(KvconnMetadata(recvs=[Recv("d-1", 77, (prefill.address,), (0, 6, 7))]))
    got = until(decode, lambda r: "d-1" in r.finished_recving)
    assert not got.failed_recving
    for name in src:
        for s, d in zip((5, 2, 3), (0, 6, 7), strict=True):
            assert torch.equal(dst[name][d], src[name][s])
        assert torch.equal(dst[name][1], torch.full_like(dst[name][1], -1.0 + 100 * int(name[13]) + 1))
    until(prefill, lambda r: "p-1" in r.finished_sending, {"p-1"})


def test_decode_with_a_prefix_hit_gets_the_tail(pair: tuple) -> None:  # type: ignore[type-arg]
    prefill, decode, src, dst = pair
    prefill.start(KvconnMetadata(sends=[Send("p-1", 78, (1, 2, 3, 4))]))
    decode.start(KvconnMetadata(recvs=[Recv("d-1", 78, (prefill.address,), (6, 7))]))
    until(decode, lambda r: "d-1" in r.finished_recving)
    for name in src:
        assert torch.equal(dst[name][6], src[name][3]) and torch.equal(dst[name][7], src[name][4])


def test_send_is_finished_only_for_a_request_vllm_finished(pair: tuple) -> None:  # type: ignore[type-arg]
    prefill, decode, _, _ = pair
    prefill.start(KvconnMetadata(sends=[Send("p-1", 79, (1,))]))
    decode.start(KvconnMetadata(recvs=[Recv("d-1", 79, (prefill.address,), (2,))]))
    until(decode, lambda r: "d-1" in r.finished_recving)
    time.sleep(0.2)
    assert not prefill.results(set()).finished_sending  # vLLM has not said p-1 finished
    until(prefill, lambda r: "p-1" in r.finished_sending, {"p-1"})


def test_unrequested_blocks_are_given_back_and_a_late_decode_recomputes(pair: tuple, clock: Clock) -> None:  # type: ignore[type-arg]
    prefill, decode, _, _ = pair
    prefill.start(KvconnMetadata(sends=[Send("p-1", 80, (1, 2))]))
    assert not prefill.results({"p-1"}).finished_sending
    clock.now += 5  # unrequested_timeout_s: nothing was ever written from them
    assert prefill.results(set()).finished_sending == {"p-1"}
    decode.start(KvconnMetadata(recvs=[Recv("d-1", 80, (prefill.address,), (3, 4))]))
    got = until(decode, lambda r: "d-1" in r.finished_recving)
    assert got.failed_recving == {"d-1"}  # recomputed, never garbage


def test_abort_in_the_same_step_as_the_recv_sends_nothing(pair: tuple) -> None:  # type: ignore[type-arg]
    prefill, decode, _, _ = pair
    decode.start(KvconnMetadata(recvs=[Recv("d-1", 81, (prefill.address,), (3,))], aborts=["d-1"]))
    assert decode.results(set()).finished_recving == {"d-1"}
    assert decode.decode is not None and decode.decode.instances() == []  # no prefill was contacted


def test_a_silent_prefill_is_given_up_after_transfer_timeout(pair: tuple, clock: Clock) -> None:  # type: ignore[type-arg]
    prefill, decode, _, _ = pair
    # Prefill never hears of room 82 from its engine: decode waits, then gives up.
    decode.start(KvconnMetadata(recvs=[Recv("d-1", 82, (prefill.address,), (3,))]))
    time.sleep(0.2)
    assert not decode.results(set()).finished_recving
    clock.now += 5
    got = until(decode, lambda r: "d-1" in r.finished_recving)
    assert got.failed_recving == {"d-1"}
    assert sum(decode.release_proofs.values()) == 1
    assert "unsafe_timeout" not in decode.release_proofs


def test_a_failed_write_is_reported_failed_after_its_blocks_are_proven_free(clock: Clock) -> None:
    prefill, _ = side(True, clock, 1.0, backend_options={"fail_chunks": "83:0"})
    decode, _ = side(False, clock, -1.0, backend_options={"fail_chunks": "83:0"})
    try:
        prefill.start(KvconnMetadata(sends=[Send("p-1", 83, (1, 2))]))
        decode.start(KvconnMetadata(recvs=[Recv("d-1", 83, (prefill.address,), (3, 4))]))
        got = until(decode, lambda r: "d-1" in r.finished_recving)
        assert got.failed_recving == {"d-1"}
        assert sum(decode.release_proofs.values()) == 1
        until(prefill, lambda r: "p-1" in r.finished_sending, {"p-1"})
    finally:
        decode.close()
        prefill.close()


def test_one_decode_endpoint_serves_two_prefill_instances_named_per_request(clock: Clock) -> None:
    first, src_a = side(True, clock, 1.0)
    second, src_b = side(True, clock, 1000.0)
    decode, dst = side(False, clock, -1.0)
    try:
        first.start(KvconnMetadata(sends=[Send("a-1", 90, (1, 2))]))
        second.start(KvconnMetadata(sends=[Send("b-1", 91, (3, 4))]))
        decode.start(
            KvconnMetadata(
                recvs=[
                    Recv("d-a", 90, (first.address,), (5, 6)),
                    Recv("d-b", 91, (second.address,), (0, 7)),
                ]
            )
        )
        got = until(decode, lambda r: {"d-a", "d-b"} <= r.finished_recving)
        assert not got.failed_recving
        for name in dst:
            assert torch.equal(dst[name][5], src_a[name][1]) and torch.equal(dst[name][6], src_a[name][2])
            assert torch.equal(dst[name][0], src_b[name][3]) and torch.equal(dst[name][7], src_b[name][4])
        assert decode.decode is not None
        assert sorted(decode.decode.instances()) == sorted([(first.address,), (second.address,)])
    finally:
        decode.close()
        first.close()
        second.close()


def test_an_unreachable_prefill_does_not_stall_requests_of_other_instances(pair: tuple) -> None:  # type: ignore[type-arg]
    prefill, _, _, _ = pair
    decode, _ = side(False, Clock(), -1.0, bootstrap_timeout_s=60, resend_interval_s=0.1)
    silent = f"tcp://127.0.0.1:{free_port()}"
    try:
        prefill.start(KvconnMetadata(sends=[Send("p-1", 92, (1,))]))
        # The old adapter bootstrapped on the engine thread: this start()
        # blocked for all of bootstrap_timeout_s.
        decode.start(
            KvconnMetadata(
                recvs=[Recv("d-silent", 93, (silent,), (2,)), Recv("d-1", 92, (prefill.address,), (3,))]
            )
        )
        got = until(decode, lambda r: "d-1" in r.finished_recving)
        assert "d-silent" not in got.finished_recving and not got.failed_recving
        assert decode.has_pending()  # d-silent waits for its instance's bootstrap
        decode.start(KvconnMetadata(aborts=["d-silent"]))
        # No prefill was ever told its blocks: they are free at once.
        assert decode.results(set()) == TransferResults(finished_recving=frozenset({"d-silent"}))
        assert not decode.has_pending()
    finally:
        decode.close()


def test_a_request_whose_prefill_never_bootstraps_is_recomputed(clock: Clock) -> None:
    decode, _ = side(False, clock, -1.0, bootstrap_timeout_s=0.5, resend_interval_s=0.05)
    silent = f"tcp://127.0.0.1:{free_port()}"
    try:
        decode.start(
            KvconnMetadata(recvs=[Recv("d-1", 94, (silent,), (2,)), Recv("d-2", 95, (silent,), (3,))])
        )
        got = until(decode, lambda r: {"d-1", "d-2"} <= r.finished_recving)
        assert got.failed_recving == {"d-1", "d-2"}
        assert sum(decode.release_proofs.values()) == 0  # nothing was ever asked of a writer
        assert not decode.has_pending()
    finally:
        decode.close()


def test_a_draining_prefill_refuses_new_rooms_and_decode_recomputes_at_once(pair: tuple) -> None:  # type: ignore[type-arg]
    prefill, decode, _src, dst = pair
    prefill.start(KvconnMetadata(sends=[Send("p-1", 90, (1,))]))
    decode.start(KvconnMetadata(recvs=[Recv("d-1", 90, (prefill.address,), (2,))]))
    until(decode, lambda r: "d-1" in r.finished_recving)
    # a finished prefill request whose decode has not asked yet
    prefill.start(KvconnMetadata(sends=[Send("p-2", 91, (3,))]))
    [report] = prefill.drain(5.0)
    assert report.drained and report.rooms_left == 0
    # its blocks are vLLM's again at once (nothing was written from them)
    until(prefill, lambda r: "p-2" in r.finished_sending, {"p-2"})
    # decode heard the drain: a new request is recomputed, no timeout waited for
    started = time.monotonic()
    decode.start(KvconnMetadata(recvs=[Recv("d-2", 91, (prefill.address,), (4,))]))
    got = until(decode, lambda r: "d-2" in r.finished_recving)
    assert "d-2" in got.failed_recving and time.monotonic() - started < 5
    for name in dst:
        assert torch.equal(dst[name][4], torch.full_like(dst[name][4], -1.0 + 100 * int(name[13]) + 4))
    assert decode.drain(1.0)[0].drained


def test_gil_switch_interval_s_applies_to_the_worker_process(clock: Clock) -> None:
    before = sys.getswitchinterval()
    try:
        prefill, _ = side(True, clock, 1.0, gil_switch_interval_s=0.0007)
        prefill.close()
        assert sys.getswitchinterval() == pytest.approx(0.0007)
    finally:
        sys.setswitchinterval(before)


# -- idle steps: waited out, not stepped through -----------------------------------
def test_an_idle_step_ends_when_the_send_settles(clock: Clock) -> None:
    """vLLM steps back to back while a finished request keeps blocks for a
    send; an idle step's results() waits for the send (woken by the write's
    barrier), so one step reports it, well before idle_wait_s."""
    prefill, src = side(True, clock, 1.0, idle_wait_s=1)
    decode, dst = side(False, clock, -1.0, idle_wait_s=1)
    try:
        # a first room: decode knows the instance (no bootstrap in the timing)
        prefill.start(KvconnMetadata(sends=[Send("p-0", 83, (1,))]))
        decode.start(KvconnMetadata(recvs=[Recv("d-0", 83, (prefill.address,), (1,))]))
        until(decode, lambda r: "d-0" in r.finished_recving)
        until(prefill, lambda r: "p-0" in r.finished_sending, {"p-0"})
        prefill.start(KvconnMetadata(sends=[Send("p-1", 84, (5, 2))]))
        assert not prefill.results({"p-1"})  # decode has not asked
        asks = threading.Timer(
            0.1, decode.start, [KvconnMetadata(recvs=[Recv("d-1", 84, (prefill.address,), (0, 6))])]
        )
        prefill.start(KvconnMetadata(idle=True))
        started = time.monotonic()
        asks.start()
        assert prefill.results(set()) == TransferResults(finished_sending=frozenset({"p-1"}))
        assert time.monotonic() - started < 0.9
        asks.join()
        decode.start(KvconnMetadata(idle=True))
        got = decode.results(set())
        assert got == TransferResults(finished_recving=frozenset({"d-1"}))
        for name in src:
            assert torch.equal(dst[name][0], src[name][5]) and torch.equal(dst[name][6], src[name][2])
    finally:
        decode.close()
        prefill.close()


def test_an_idle_step_waits_at_most_idle_wait_s_and_a_busy_step_never(clock: Clock) -> None:
    prefill, _ = side(True, clock, 1.0, idle_wait_s=0.3)
    try:
        prefill.start(KvconnMetadata(sends=[Send("p-1", 85, (1,))]))  # nobody asks for it
        started = time.monotonic()
        assert not prefill.results({"p-1"})
        assert time.monotonic() - started < 0.2  # a step that runs requests answers at once
        prefill.start(KvconnMetadata(idle=True))
        started = time.monotonic()
        assert not prefill.results(set())
        assert 0.25 < time.monotonic() - started < 3
    finally:
        prefill.close()


# -- decode with more TP ranks than prefill ------------------------------------------
def test_two_decode_ranks_each_get_their_head_from_one_prefill_rank(clock: Clock) -> None:
    """Prefill TP 1 holds both KV heads; decode TP 2 holds one per rank. Each
    decode rank asks prefill's one rank; nothing is written until both
    asked (the sender waits for every decode rank), then each gets its head."""
    prefill, src = side(True, clock, 1.0)
    ranks = []
    one_head = attrs.evolve(GEOMETRY, num_kv_heads=1)
    for r in (0, 1):
        settings = Settings.parse({"write_timeout_s": 1, "abort_timeout_s": 2})
        worker = WorkerSide(settings, False, True, one_head, tp_size=2, tp_rank=r, clock=clock)
        caches = {
            name: torch.full((one_head.num_blocks, 1, 2 * one_head.block_size, one_head.head_size), -1.0)
            for name in src
        }
        worker.register(caches)
        ranks.append((worker, caches))
    try:
        prefill.start(KvconnMetadata(sends=[Send("p-1", 86, (5, 2))]))
        (first, first_dst), (second, _) = ranks
        first.start(KvconnMetadata(recvs=[Recv("d-1", 86, (prefill.address,), (0, 6))]))
        time.sleep(0.3)
        assert not first.results(set()) and not prefill.results({"p-1"})  # rank 1 has not asked
        assert all(bool((first_dst[name] == -1.0).all()) for name in src)
        second.start(KvconnMetadata(recvs=[Recv("d-1", 86, (prefill.address,), (0, 6))]))
        # Both ranks step, as vLLM steps every worker: each opens its request in a step.
        got: dict[int, TransferResults] = {}
        deadline = time.monotonic() + 20
        while len(got) < 2 and time.monotonic() < deadline:
            for worker, _ in ranks:
                result = worker.results(set())
                if result:
                    got[worker.tp_rank] = result
            time.sleep(0.01)
        assert got == {r: TransferResults(finished_recving=frozenset({"d-1"})) for r in (0, 1)}
        for worker, dst in ranks:
            for name in src:
                head = worker.tp_rank
                assert torch.equal(dst[name][0][0], src[name][5][head])
                assert torch.equal(dst[name][6][0], src[name][2][head])
        until(prefill, lambda r: "p-1" in r.finished_sending, {"p-1"})
    finally:
        for worker, _ in ranks:
            worker.close()
        prefill.close()


def test_the_first_request_after_a_prefill_restarts_at_its_address_is_received_not_recomputed(
    clock: Clock,
) -> None:
    """Issue 40, finding 3, for vLLM: a prefill rank restarted at its address
    (kv_connector_extra_config's ``port``). Before, decode's first request
    after the restart went to the earlier process's session, the new one
    dropped it, and the request was recomputed once decode saw the restart;
    now decode asks who answers there first and the new process writes it."""
    port = free_port()
    first, _ = side(True, clock, 1.0, port=port)
    decode, dst = side(False, clock, -1.0)
    second: WorkerSide | None = None
    try:
        first.start(KvconnMetadata(sends=[Send("p-1", 92, (1, 2))]))
        decode.start(KvconnMetadata(recvs=[Recv("d-1", 92, (first.address,), (3, 4))]))
        assert not until(decode, lambda r: "d-1" in r.finished_recving).failed_recving
        address = first.address
        first.close()  # its port frees; this process lives on (no exit proof)
        wait_for(lambda: bool(decode.decode and decode.decode.unavailable((address,))), 20, "the link's loss")
        second, src = at_the_same_address(lambda: side(True, clock, 1000.0, port=port))
        assert second.address == address
        second.start(KvconnMetadata(sends=[Send("p-2", 93, (5, 6))]))
        decode.start(KvconnMetadata(recvs=[Recv("d-2", 93, (address,), (0, 7))]))
        got = until(decode, lambda r: "d-2" in r.finished_recving)
        assert not got.failed_recving  # received, not recomputed
        for name in dst:
            assert torch.equal(dst[name][0], src[name][5]) and torch.equal(dst[name][7], src[name][6])
        assert decode.decode is not None and decode.decode.metrics.value("kvconn_rank_restarts_total") == 1
    finally:
        decode.close()
        if second is not None:
            second.close()
