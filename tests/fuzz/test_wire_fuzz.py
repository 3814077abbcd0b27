"""Fuzzing the control-message decoders and the listener's deliver path.

Every input either decodes to a message that re-encodes to the same frame, or
raises FrameError with a known reason; the listener counts every bad frame and
never raises. CI runs a few thousand inputs; ``-m slow`` runs >= 100,000.
"""

from __future__ import annotations

import os
import random
import struct
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconn.protocol import wire
from kvconn.protocol.messages import (
    Abort,
    AbortAck,
    Hello,
    HelloAck,
    Message,
    RoomOutcome,
    RoomStatus,
    TcpConnection,
    TransferRequest,
)
from kvconn.runtime.control import Listener

KEY = b"k" * 32
REASONS = {
    "oversize",
    "short",
    "bad_mac",
    "bad_magic",
    "bad_version",
    "unknown_tag",
    "bad_body",
    "trailing_bytes",
}
CI_EXAMPLES = int(os.environ.get("KVCONN_FUZZ_EXAMPLES", "1500"))
SLOW_EXAMPLES = 100_000
COUNT: Counter[str] = Counter()

u64 = st.integers(0, (1 << 64) - 1)
u32 = st.integers(0, (1 << 32) - 1)
text = st.text(max_size=40)
messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Hello, text, text, text, u64, u64, u64, st.binary(max_size=64), st.binary(max_size=64)),
    st.builds(HelloAck, u64, text, text, u64, u64, text, u64),
    st.builds(
        TransferRequest,
        u64,
        text,
        st.lists(st.integers(0, (1 << 32) - 1), max_size=64).map(tuple),
        u64,
        u64,
        u64,
        trace=st.binary(max_size=80),  # the optional trailing field, absent when empty
    ),
    st.builds(Abort, u64, u64, text, text, trace=st.binary(max_size=80)),
    st.builds(
        AbortAck,
        u64,
        u64,
        u64,
        st.booleans(),
        text,
        u64,
        st.lists(st.builds(TcpConnection, text, u32, text, u32), max_size=4).map(tuple),
    ),
    st.builds(RoomStatus, u64, u64, st.sampled_from(list(RoomOutcome)), text, text, u64),
)


def _check(frame: bytes, key: bytes | None) -> None:
    COUNT["inputs"] += 1
    try:
        msg = wire.decode(frame, key)
    except wire.FrameError as exc:
        assert exc.reason in REASONS, exc
        return
    assert wire.encode(msg, key) == frame  # a decodable frame is canonical


def _mutate(frame: bytes, rnd: random.Random) -> bytes:
    kind = rnd.randrange(7)
    b = bytearray(frame)
    if kind == 0 and b:  # bit flips
        for _ in range(rnd.randint(1, 4)):
            i = rnd.randrange(len(b))
            b[i] ^= 1 << rnd.randrange(8)
    elif kind == 1:  # truncation
        del b[rnd.randrange(len(b) + 1) :]
    elif kind == 2:  # trailing bytes
        b += rnd.randbytes(rnd.randint(1, 16))
    elif kind == 3 and len(b) > 2:  # wrong version
        b[2] = rnd.choice([0, 2, 255])
    elif kind == 4 and len(b) > 3:  # wrong or other tag
        b[3] = rnd.randrange(256)
    elif kind == 5 and len(b) > 8:  # a huge length prefix somewhere
        i = rnd.randrange(4, len(b) - 3)
        b[i : i + 4] = struct.pack(">I", rnd.choice([0xFFFFFFFF, 1 << 21, len(b) * 2]))
    else:  # splice random bytes in
        i = rnd.randrange(len(b) + 1)
        b[i:i] = rnd.randbytes(rnd.randint(1, 8))
    return bytes(b)


def _fuzz_decoders(n: int) -> None:
    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(
        raw=st.binary(max_size=256),
        msg=messages,
        seed=st.integers(0, 2**32),
        key=st.sampled_from([None, KEY]),
    )
    def run(raw: bytes, msg: Message, seed: int, key: bytes | None) -> None:
        _check(raw, key)
        _check(b"KV\x01" + raw, key)
        good = wire.encode(msg, key)
        _check(good, key)
        assert wire.decode(good, key) == msg
        rnd = random.Random(seed)
        for _ in range(4):
            _check(_mutate(good, rnd), key)
        # a keyed frame read without the key, and an unkeyed one read with it
        other = KEY if key is None else None
        _check(wire.encode(msg, other), key)

    run()


class _Sink:
    def __init__(self) -> None:
        self.drops: Counter[str] = Counter()
        self.handled = 0

    def handler(self, msg: Message) -> None:
        self.handled += 1
        if isinstance(msg, AbortAck) and msg.rank == 13:
            raise RuntimeError("a handler that raises is counted too")

    def on_drop(self, reason: str) -> None:
        self.drops[reason] += 1


def _fuzz_listener(n: int) -> None:
    sink = _Sink()
    listener = Listener("fuzz", "127.0.0.1", 0, sink.handler, sink.on_drop, KEY)
    listener.start()  # its thread idles: nobody sends to its socket here
    expected_bad = 0
    expected_good = 0
    expected_handler_errors = 0
    try:

        @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(msg=messages, seed=st.integers(0, 2**32), raw=st.binary(max_size=128))
        def run(msg: Message, seed: int, raw: bytes) -> None:
            nonlocal expected_bad, expected_good, expected_handler_errors
            rnd = random.Random(seed)
            good = wire.encode(msg, KEY)
            for frame in (raw, _mutate(good, rnd), wire.encode(msg, None), good):
                COUNT["inputs"] += 1
                try:
                    decoded = wire.decode(frame, KEY)
                except wire.FrameError:
                    expected_bad += 1
                else:
                    expected_good += 1
                    if isinstance(decoded, AbortAck) and decoded.rank == 13:
                        expected_handler_errors += 1
                listener.deliver(frame)  # must never raise

        run()
    finally:
        listener.close()
    assert sink.handled == expected_good
    assert sum(v for k, v in sink.drops.items() if k != "handler_error") == expected_bad
    assert sink.drops["handler_error"] == expected_handler_errors
    assert sink.drops["bad_mac"] > 0


def test_fuzz_decoders() -> None:
    _fuzz_decoders(CI_EXAMPLES)


def test_fuzz_listener_deliver() -> None:
    _fuzz_listener(max(200, CI_EXAMPLES // 3))


def test_oversized_frames_bounded() -> None:
    big = wire.MAX_FRAME + 1
    for key in (None, KEY):
        with pytest.raises(wire.FrameError) as exc:
            wire.decode(b"KV" + bytes([wire.VERSION, 5]) + b"\0" * big, key)
        assert exc.value.reason == "oversize"
    with pytest.raises(ValueError):
        wire.encode(TransferRequest(1, "d", tuple(range(wire.MAX_FRAME // 4 + 1)), 1, 1))
    # a length prefix claiming far more than the frame holds is refused, not allocated
    frame = b"KV" + bytes([wire.VERSION, 3]) + struct.pack(">Q", 1) + struct.pack(">I", 0xFFFFFFF0)
    with pytest.raises(wire.FrameError) as exc:
        wire.decode(frame)
    assert exc.value.reason == "bad_body"


def test_listener_socket_survives_garbage() -> None:
    """Over a real socket: garbage, oversized and unkeyed frames are dropped,
    counted, and a valid frame behind them is still handled."""
    import time

    import zmq

    sink = _Sink()
    listener = Listener("fuzz-sock", "127.0.0.1", 0, sink.handler, sink.on_drop, KEY)
    listener.start()
    ctx = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(listener.address)
    try:
        rnd = random.Random(7)
        for _ in range(300):
            push.send(rnd.randbytes(rnd.randint(0, 200)))
        push.send(wire.encode(AbortAck(1, 2, 3, False)))  # unkeyed
        push.send(wire.encode(AbortAck(1, 2, 3, False), KEY))
        deadline = time.monotonic() + 10
        while sink.handled < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sink.handled == 1
        assert sum(sink.drops.values()) == 301
        # a frame over ZMQ's MAXMSGSIZE is refused by the socket (the peer is
        # disconnected); the listener lives on for other peers
        push.send(b"x" * (wire.MAX_FRAME + wire.MAC_BYTES + 1))
        push2 = ctx.socket(zmq.PUSH)
        push2.setsockopt(zmq.LINGER, 0)
        push2.connect(listener.address)
        push2.send(wire.encode(AbortAck(4, 5, 6, True), KEY))
        deadline = time.monotonic() + 10
        while sink.handled < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sink.handled == 2
        push2.close()
    finally:
        push.close()
        listener.close()


@pytest.mark.slow
def test_fuzz_long() -> None:
    COUNT.clear()
    _fuzz_decoders(SLOW_EXAMPLES // 6)
    _fuzz_listener(SLOW_EXAMPLES // 12)
    print(f"\nfuzzed {COUNT['inputs']} inputs")
    assert COUNT["inputs"] >= SLOW_EXAMPLES
