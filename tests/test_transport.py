"""The TCP transport over real sockets: ordering, sizes, priority, goodbyes, failures, bad frames.

Two transports are joined by a real connected socket pair and driven by one thread here; the
sink records what arrives. (The engine is not involved: these are the transport's own rules.)
"""

from __future__ import annotations

import os
import socket
import struct
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncreduce.algorithms import (
    DTYPES,
    REDUCIBLE,
    REDUCTION_CODES,
    REDUCTIONS,
    Combining,
    Swap,
    combine,
)
from asyncreduce.samehost.shm import create_arena, open_arena
from asyncreduce.transport.base import COMBINED, ELSEWHERE
from asyncreduce.transport.frame import (
    DATA,
    FLAG_SHM,
    HEADER,
    MAX_NAME_BYTES,
    Descriptor,
    FrameError,
    Header,
    pack_header,
    parse_header,
    with_step,
)
from asyncreduce.transport.pairs import native_take
from asyncreduce.transport.tcp import TcpTransport

try:
    from asyncreduce.transport._stream_core import COMBINED as COMBINED_HERE
    from asyncreduce.transport._stream_core import FRAME as FRAME_HERE
    from asyncreduce.transport._stream_core import combines as native_combines
    from asyncreduce.transport._stream_core import swap as native_swap
    from asyncreduce.transport._stream_core import swaps as native_swaps
except ImportError:  # not built: the C tests skip
    native_swap = native_swaps = None  # type: ignore[assignment]

DESC = Descriptor(1, 2, 1, 0, 10)


class Sink:
    def __init__(self) -> None:
        self.frames: list[tuple[int, Header, bytes]] = []
        self.sent: list[object] = []
        self.lost: list[tuple[int, BaseException]] = []
        self.direct: dict[bytes, bytearray] = {}

    def frame_buffer(self, peer: int, header: Header) -> memoryview | None:
        target = self.direct.get(header.name)
        return memoryview(target) if target is not None else None

    def frame_view(self, peer: int, header: Header, view: memoryview) -> bool:
        return False  # copy it out, like an operation that is not posted yet

    def on_frame(self, peer: int, header: Header, payload: memoryview) -> None:
        self.frames.append((peer, header, bytes(payload)))

    def on_sent(self, token: object) -> None:
        self.sent.append(token)

    def on_peer_lost(self, peer: int, error: BaseException) -> None:
        self.lost.append((peer, error))


KINDS = ["tcp", "tcp+shm"]  # every conformance test runs on both data planes


def pair() -> tuple[TcpTransport, Sink, TcpTransport, Sink]:
    a, b = socket.socketpair()
    sa, sb = Sink(), Sink()
    return TcpTransport(0, {1: a}, sa), sa, TcpTransport(1, {0: b}, sb), sb


def pump(*transports: TcpTransport, until: object, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not until():  # type: ignore[operator]
        assert time.monotonic() < deadline, "transport made no progress"
        for t in transports:
            t.poll(0.001)


def frame(name: bytes, payload: bytes, step: int = 0) -> tuple[bytes, memoryview]:
    return pack_header(DATA, name, 0, step, 0, len(payload), DESC), memoryview(payload)


@pytest.mark.parametrize("kind", KINDS)
def test_frames_arrive_in_order_with_zero_length_and_large_payloads(kind: str) -> None:
    ta, sa, tb, sb = PAIRS[kind]()
    big = os.urandom(8 << 20)
    payloads = [b"", b"x", big, b"", os.urandom(100_000)] + [bytes([i]) * i for i in range(50)]
    for i, p in enumerate(payloads):
        head, body = frame(b"op", p, step=i)
        ta.send(1, head, body, 0, i)
    pump(ta, tb, until=lambda: len(sb.frames) == len(payloads))
    assert [h.step for _, h, _ in sb.frames] == list(range(len(payloads)))
    assert [p for _, _, p in sb.frames] == payloads
    assert sorted(sa.sent) == list(range(len(payloads)))  # type: ignore[type-var]
    assert all(peer == 0 for peer, _, _ in sb.frames)
    ta.close()
    tb.close()


@pytest.mark.parametrize("kind", KINDS)
def test_payload_lands_in_the_buffer_the_sink_names(kind: str) -> None:
    ta, _, tb, sb = PAIRS[kind]()
    target = bytearray(1 << 20)
    sb.direct[b"direct"] = target
    data = np.arange(1 << 18, dtype=np.float32).tobytes()
    ta.send(1, *frame(b"direct", data), 0, None)
    pump(ta, tb, until=lambda: sb.frames)
    assert bytes(target) == data
    ta.close()
    tb.close()


@pytest.mark.parametrize("kind", KINDS)
def test_higher_priority_frames_overtake_queued_ones(kind: str) -> None:
    ta, _, tb, sb = PAIRS[kind]()
    filler = b"\0" * (16 << 20)  # fills the socket, so the rest must queue
    ta.send(1, *frame(b"bulk", filler), 0, "bulk")
    for i in range(5):
        ta.send(1, *frame(b"low", b"l", step=i), 0, f"low{i}")
    ta.send(1, *frame(b"urgent", b"u"), 10, "urgent")
    pump(ta, tb, until=lambda: len(sb.frames) == 7)
    names = [h.name for _, h, _ in sb.frames]
    assert names.index(b"urgent") < names.index(b"low")
    ta.close()
    tb.close()


@pytest.mark.parametrize("kind", KINDS)
def test_goodbye_then_close_is_not_a_failure(kind: str) -> None:
    ta, sa, tb, sb = PAIRS[kind]()
    ta.send_goodbye(b"rank 0 is done")
    pump(ta, tb, until=lambda: sb.frames)
    assert sb.frames[0][2] == b"rank 0 is done"
    tb.release(0)
    pump(ta, tb, until=lambda: ta.open_peers() == 0 and tb.open_peers() == 0)
    assert sa.lost == [] and sb.lost == []
    ta.close()
    tb.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_vanished_peer_is_reported_once(kind: str) -> None:
    ta, sa, tb, sb = PAIRS[kind]()
    ta.send(1, *frame(b"x", b"a" * 1000), 0, None)
    pump(ta, tb, until=lambda: sb.frames)
    ta.close()  # no goodbye: as if the process died
    pump(tb, until=lambda: sb.lost)
    for _ in range(10):
        tb.poll(0.001)
    assert len(sb.lost) == 1 and sb.lost[0][0] == 0
    token = object()
    tb.send(0, *frame(b"y", b"z"), 0, token)  # to the vanished peer: dropped, reported sent
    assert sb.sent[-1] is token and len(sb.lost) == 1
    with pytest.raises(KeyError, match="never connected"):
        tb.send(7, *frame(b"y", b""), 0, None)
    tb.close()


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 64,
        HEADER.pack(b"ARDC", 9, DATA, 0, 0, 0, 0, 0, 1, 2, 1, 0, 0, 0),  # bad version
        HEADER.pack(b"ARDC", 1, DATA, 0, 0, 0, 0, 1 << 40, 1, 2, 1, 0, 0, 0),  # huge payload
        HEADER.pack(b"ARDC", 1, DATA, 60000, 0, 0, 0, 0, 1, 2, 1, 0, 0, 0),  # huge name
        HEADER.pack(b"ARDC", 1, 77, 0, 0, 0, 0, 0, 1, 2, 1, 0, 0, 0),  # unknown type
    ],
)
def test_a_frame_that_breaks_the_protocol_drops_the_connection(garbage: bytes) -> None:
    a, b = socket.socketpair()
    sink = Sink()
    transport = TcpTransport(1, {0: b}, sink)
    a.sendall(garbage)
    pump(transport, until=lambda: sink.lost)
    assert isinstance(sink.lost[0][1], FrameError) and sink.frames == []
    a.close()
    transport.close()


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=HEADER.size, max_size=HEADER.size))
def test_parse_header_rejects_or_returns_bounded_fields(data: bytes) -> None:
    try:
        name_len, header = parse_header(data)
    except (FrameError, struct.error):
        return
    assert name_len <= MAX_NAME_BYTES
    assert header.payload_len <= 1 << 30


# ---- the shared-memory data plane --------------------------------------------------------------


def shm_pair(size: int = 1 << 20) -> tuple[TcpTransport, Sink, TcpTransport, Sink]:
    a, b = socket.socketpair()
    seg_ab, out_ab = create_arena(size)
    seg_ba, out_ba = create_arena(size)
    in_ab, in_ba = open_arena(seg_ab.name, size), open_arena(seg_ba.name, size)
    seg_ab.close()
    seg_ba.close()
    sa, sb = Sink(), Sink()
    ta = TcpTransport(0, {1: a}, sa, {1: (out_ab, in_ba)})
    tb = TcpTransport(1, {0: b}, sb, {0: (out_ba, in_ab)})
    return ta, sa, tb, sb


PAIRS = {"tcp": pair, "tcp+shm": lambda: shm_pair(8 << 20)}


def test_large_payloads_go_through_shared_memory_in_order_and_wrap_around() -> None:
    ta, sa, tb, sb = shm_pair(4 << 20)  # smaller than what is sent: credits must flow
    payloads = [os.urandom(n) for n in [300_000, 17, 500_000, 20_000, 0] * 8]
    for i, p in enumerate(payloads):
        ta.send(1, *frame(b"op", p, step=i), 0, i)
    pump(ta, tb, until=lambda: len(sb.frames) == len(payloads))
    assert [p for _, _, p in sb.frames] == payloads
    assert [h.step for _, h, _ in sb.frames] == list(range(len(payloads)))
    assert sum(1 for _, h, _ in sb.frames if h.flags & FLAG_SHM) == 24  # the large ones
    ta.close()
    tb.close()


def test_a_sink_may_consume_straight_from_shared_memory() -> None:
    ta, _, tb, sb = shm_pair()
    seen: list[bytes] = []
    sb.frame_view = lambda peer, header, view: seen.append(bytes(view)) or True  # type: ignore[method-assign]
    data = os.urandom(100_000)
    ta.send(1, *frame(b"v", data), 0, None)
    pump(ta, tb, until=lambda: seen)
    assert seen == [data] and sb.frames == []
    ta.close()
    tb.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_sink_may_consume_small_frames_where_they_were_received(kind: str) -> None:
    """Frames that came whole into the receive staging may be consumed there (frame_view);
    the ones behind them in the same read still arrive, whole and in order."""
    ta, _, tb, sb = PAIRS[kind]()
    seen: list[tuple[int, bytes]] = []

    def view(peer: int, header: Header, staged: memoryview) -> bool:
        if header.step % 2:
            return False  # odd steps take the usual path
        seen.append((header.step, bytes(staged)))
        staged[:] = b"\xee" * len(staged)  # scribbled at once: nothing may read it later
        return True

    sb.frame_view = view  # type: ignore[method-assign]
    payloads = [os.urandom(n) for n in [1, 100, 0, 4096, 7, 3000] * 5]
    for i, p in enumerate(payloads):
        ta.send(1, *frame(b"s", p, step=i), 0, i)
    pump(ta, tb, until=lambda: len(seen) + len(sb.frames) == len(payloads))
    viewed = [(i, p) for i, p in enumerate(payloads) if i % 2 == 0 and p]
    assert seen == viewed
    rest = [(i, p) for i, p in enumerate(payloads) if (i, p) not in viewed]
    assert [(h.step, p) for _, h, p in sb.frames] == rest
    ta.close()
    tb.close()


def loopback_tcp() -> tuple[socket.socket, socket.socket]:
    """A connected TCP pair over the loopback (SO_RCVLOWAT acts on TCP's readiness)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    return a, b


def test_a_large_payload_trickling_in_is_read_whole() -> None:
    """A payload far larger than the socket's low-water mark, sent in small pieces with pauses,
    is delivered whole, and the frame behind it too (SO_RCVLOWAT is lowered to what is left)."""
    a, b = loopback_tcp()
    sink = Sink()
    tb = TcpTransport(1, {0: b}, sink)
    data = os.urandom(3 << 20)
    head, _ = frame(b"big", data)
    stream = head + data + b"".join(frame(b"after", b"tail"))
    a.setblocking(True)
    for start in range(0, len(stream), 300_000):
        a.sendall(stream[start : start + 300_000])
        for _ in range(5):
            tb.poll(0.002)
    pump(tb, until=lambda: len(sink.frames) == 2)
    assert [(h.name, p) for _, h, p in sink.frames] == [(b"big", data), (b"after", b"tail")]
    assert tb._peers[0].lowat == 1  # back to waking for the next header
    a.close()
    tb.close()


def test_a_peer_dying_mid_payload_is_reported_at_once() -> None:
    """The low-water mark set for the rest of a payload does not delay the EOF."""
    a, b = loopback_tcp()
    sink = Sink()
    tb = TcpTransport(1, {0: b}, sink)
    data = os.urandom(2 << 20)
    head, _ = frame(b"big", data)
    a.sendall(head + data[:200_000])
    for _ in range(20):
        tb.poll(0.002)
    assert tb._peers[0].lowat > 1
    a.close()
    start = time.monotonic()
    pump(tb, until=lambda: sink.lost, limit=2.0)
    assert time.monotonic() - start < 1.0 and sink.frames == []
    tb.close()


def test_arena_files_are_private_and_refuse_impostors(tmp_path: object) -> None:
    segment, arena = create_arena(1 << 16)
    try:
        assert os.fstat(segment.fd).st_mode & 0o777 == 0o600
        with pytest.raises(ValueError):
            open_arena("/etc/passwd", 1 << 16)
        with pytest.raises(ValueError):
            open_arena(segment.name, 1 << 17)  # wrong size
        with open(__file__) as other:  # a descriptor of ours that is no segment
            pid, _, dev, ino = segment.name.split(":")[1:]
            with pytest.raises(ValueError):
                open_arena(f"memfd:{pid}:{other.fileno()}:{dev}:{ino}", 1 << 16)
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"asyncreduce-{pid}-")]
    finally:
        segment.close()
        arena.close()


def test_arena_never_deadlocks_on_the_skipped_tail() -> None:
    """The transport's protocol (write while room; reader consumes in order and credits in
    batches) never leaves a writer waiting with nothing left for the reader to consume."""
    size = 1 << 16
    segment, writer = create_arena(size)
    reader = open_arena(segment.name, size)
    segment.close()
    sizes = np.random.default_rng(0).integers(1, writer.window // 2 + 1, 3000)
    in_flight: list[int] = []
    for n in map(int, sizes):
        while not writer.write(memoryview(bytes(n))):
            assert in_flight, f"deadlock: writer waits at {writer.position}, reader has nothing"
            reader.read(in_flight.pop(0))
            if reader.credit_due():
                reader.credited = reader.position
                writer.credit(reader.position)
        in_flight.append(n)
    writer.close()
    reader.close()


def test_the_kernel_holds_only_a_little_of_a_connections_unsent_frames(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Frames leave by priority only while they wait in our queue: the mesh's sockets keep at
    most NOT_SENT_BYTES unsent in the kernel (TCP_NOTSENT_LOWAT), ASYNCREDUCE_NOTSENT_KIB=0
    lifts the limit, and a value that is not a number is refused with its name."""
    import socket

    from asyncreduce.errors import UsageError
    from asyncreduce.transport import mesh

    def lowat(env: str | None) -> int:
        if env is None:
            monkeypatch.delenv("ASYNCREDUCE_NOTSENT_KIB", raising=False)
        else:
            monkeypatch.setenv("ASYNCREDUCE_NOTSENT_KIB", env)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            mesh._tune(sock, mesh.not_sent_bytes())
            return sock.getsockopt(socket.IPPROTO_TCP, mesh._TCP_NOTSENT_LOWAT)

    assert lowat(None) == mesh.NOT_SENT_BYTES == 256 << 10
    assert lowat("64") == 64 << 10
    assert lowat("0") == 0  # not set: the kernel's default (net.ipv4.tcp_notsent_lowat)
    with pytest.raises(UsageError, match="ASYNCREDUCE_NOTSENT_KIB='lots'"):
        lowat("lots")


# ---- around the queue and the reader: what a thread that runs an operation itself uses ------


#: take_frame's two looks: in C (_stream_core, where it was built) and in Python
TAKES = [pytest.param(True, id="native"), pytest.param(False, id="python")]


def tcp_pair(native: bool = True) -> tuple[TcpTransport, Sink, TcpTransport, Sink]:
    """Two transports over a real loopback TCP connection (as the mesh makes them), whose
    take_frame looks in C (``native``, where it was built) or in Python."""
    if native and native_take is None:
        pytest.skip("asyncreduce.transport._stream_core was not built")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    for sock in (a, b):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sa, sb = Sink(), Sink()
    ta, tb = TcpTransport(0, {1: a}, sa), TcpTransport(1, {0: b}, sb)
    ta._pairs.native = tb._pairs.native = native
    return ta, sa, tb, sb


def take_when_here(t: TcpTransport, head: bytes, size: int) -> memoryview | None:
    """``take_frame`` until it answers other than "not all here yet" (at most 5 s)."""
    deadline = time.monotonic() + 5
    while (got := t.take_frame(0, head, size)) is None and time.monotonic() < deadline:
        time.sleep(0.001)
    return got


@pytest.mark.parametrize("native", TAKES)
def test_take_frame_takes_exactly_the_frame_it_expects_and_leaves_anything_else(
    native: bool,
) -> None:
    ta, sa, tb, sb = tcp_pair(native)
    payload = os.urandom(4096)
    head, body = frame(b"op", payload, step=1)
    assert tb.quiet(0, len(payload)) and ta.quiet(1, len(payload))
    assert tb.take_frame(0, head, len(payload)) is None  # nothing there yet
    # only part of it: not yet, and nothing is taken
    ta._peers[1].sock.sendall(head + payload[:1000])
    time.sleep(0.05)
    assert tb.take_frame(0, head, len(payload)) is None
    ta._peers[1].sock.sendall(payload[1000:])
    got = take_when_here(tb, head, len(payload))
    assert got is not None and got is not ELSEWHERE and bytes(got) == payload
    # another frame first (another step of the same operation): left for poll to read
    other_head, other_body = frame(b"op", payload, step=2)
    ta.send(1, other_head, other_body, 0, "other")
    assert take_when_here(tb, head, len(payload)) is ELSEWHERE
    pump(ta, tb, until=lambda: len(sb.frames) == 1)
    assert sb.frames[0][1].step == 2 and sb.frames[0][2] == payload and not sb.lost
    # a frame of the expected header but another size is another frame too
    ta.send(1, *frame(b"op", payload[:-4], step=1), 0, "short")
    assert take_when_here(tb, head, len(payload)) is ELSEWHERE
    pump(ta, tb, until=lambda: len(sb.frames) == 2)
    assert sb.frames[1][2] == payload[:-4]
    # the peer's end: something for poll to read (and report) too
    ta.close()
    assert take_when_here(tb, head, len(payload)) is ELSEWHERE
    pump(tb, until=lambda: bool(sb.lost))
    tb.close()


@pytest.mark.parametrize("native", TAKES)
def test_a_frame_begun_by_a_taker_that_gives_up_is_read_whole_by_poll(native: bool) -> None:
    """A direct run that gave up on its partner's frame half way (the loop takes it over):
    the first part, which only the look has seen (the C look takes it off the stream), and
    the rest reach the sink as one frame, and the connection is not quiet until then."""
    ta, sa, tb, sb = tcp_pair(native)
    payload = os.urandom(4096)
    head, body = frame(b"op", payload, step=1)
    ta._peers[1].sock.sendall(head + payload[:1000])
    time.sleep(0.05)
    assert tb.take_frame(0, head, len(payload), 0.001) is None
    assert tb.quiet(0, len(payload)) is (not native)  # (Python's look took nothing)
    ta._peers[1].sock.sendall(payload[1000:])
    pump(ta, tb, until=lambda: len(sb.frames) == 1)
    assert sb.frames[0][1].step == 1 and sb.frames[0][2] == payload and not sb.lost
    assert tb.quiet(0, len(payload))
    ta.close()
    tb.close()


@pytest.mark.parametrize("native", TAKES)
def test_take_frame_hands_a_reset_and_what_came_before_it_to_the_sink(native: bool) -> None:
    """A frame of another operation, then a reset: the frame reaches the sink, then the loss."""
    ta, sa, tb, sb = tcp_pair(native)
    payload = os.urandom(512)
    ta._peers[1].sock.sendall(b"".join(frame(b"other", payload, step=1)))
    ta._peers[1].sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    ta.close()  # (lingering 0 s: a reset)
    time.sleep(0.05)
    head, _ = frame(b"op", payload, step=1)
    assert take_when_here(tb, head, len(payload)) is ELSEWHERE
    pump(tb, until=lambda: bool(sb.lost))
    assert [f[2] for f in sb.frames] == [payload] and sb.lost[0][0] == 0
    tb.close()


@pytest.mark.parametrize("native", TAKES)
def test_a_connection_is_quiet_only_with_nothing_queued_or_half_read(native: bool) -> None:
    ta, sa, tb, sb = tcp_pair(native)
    ta.send(1, *frame(b"big", bytes(32 << 20)), 0, "big")  # far more than the socket holds
    assert not ta.quiet(1, 64)  # frames of it wait to leave
    deadline = time.monotonic() + 10
    while not tb._peers[0].reader.payload and time.monotonic() < deadline:
        tb.poll(0.001)  # its header, then part of its payload
    assert not tb.quiet(0, 64)  # a frame half read
    # quiet again once it all left (the sender may look once more after the reader has it
    # all: a write that ended a 4 MiB burst leaves the socket watched until the next poll)
    pump(ta, tb, until=lambda: len(sb.frames) == 1 and ta.quiet(1, 64))
    assert tb.quiet(0, 64)
    assert not tb.quiet(5, 64)  # no such peer
    ta.close()
    tb.close()


def test_send_now_says_whether_the_frame_left_whole_and_keeps_the_order() -> None:
    """``send_now`` (a direct run's send): True for a frame that went straight into the
    socket; False for one that did not leave whole (the loop writes the rest) and for one
    behind a queue (it waits its turn, as ``send``'s frames do), which all arrive in order."""
    ta, sa, tb, sb = tcp_pair()
    small = os.urandom(1024)
    assert ta.send_now(1, *frame(b"op", small, step=1), 0)
    big = os.urandom(32 << 20)  # far more than the socket holds
    assert not ta.send_now(1, *frame(b"op", big, step=2), 0)
    assert not ta.quiet(1, 64)
    assert not ta.send_now(1, *frame(b"op", small, step=3), 0)  # behind the rest of it
    pump(ta, tb, until=lambda: len(sb.frames) == 3)
    assert [(h.step, p) for _, h, p in sb.frames] == [(1, small), (2, big), (3, small)]
    assert sa.sent == [None, None, None] and not sb.lost
    ta.close()
    tb.close()


WHOLE = b"8 bytes!"  # a name whose header (48 bytes and the name) ends at a multiple of 8,
# so C combines what follows it (of any element type): see the last test of this file

#: What _stream_core.swap combines in C: every reduction of these element types (bool,
#: float16, bfloat16 and complex are numpy's: ``combines`` says no)
NATIVE_COMBINES = [(d, op) for d in ("float32", "float64", "int8", "int16", "int32", "int64",
                                     "uint8") for op in REDUCTIONS
                   if (DTYPES[d].code, op) in REDUCIBLE]  # fmt: skip


def _operands(dtype: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random pairs of ``dtype``, and for floats first the pairs whose result's bits depend
    on the order of the operands: -0.0 against 0.0, a NaN against a number and against
    another NaN (another payload), infinities."""
    if not dtype.startswith("float"):
        info = np.iinfo(dtype)
        return tuple(rng.integers(info.min, info.max, 509, dtype=dtype, endpoint=True)
                     for _ in range(2))  # type: ignore[return-value]  # fmt: skip
    nan_a, nan_b = (np.array([bits], "u8").view("f8").astype(dtype) for bits in
                    (0x7FF8000000000001, 0xFFF8000000000002))  # fmt: skip
    first = [0.0, -0.0, np.nan, 1.0, nan_a[0], np.inf, -np.inf, np.inf]
    second = [-0.0, 0.0, 1.0, np.nan, nan_b[0], -np.inf, np.inf, np.inf]
    a, b = (rng.standard_normal(509).astype(dtype) * 1e30 for _ in range(2))
    a[:8], b[:8] = first, second
    return a, b


@pytest.mark.skipif(native_swap is None, reason="asyncreduce.transport._stream_core was not built")
@pytest.mark.parametrize(("dtype", "op"), NATIVE_COMBINES)
def test_swap_combines_what_arrives_as_numpy_does(dtype: str, op: str) -> None:
    """A direct run's step in one call: its frame sent, the partner's taken and combined into
    the buffer in C, bit for bit as ``reduction.combine`` (both operand orders: a tie of -0.0
    and 0.0, which NaN), integers wrapping."""
    assert native_combines(DTYPES[dtype].code, REDUCTION_CODES[op])
    rng = np.random.default_rng(len(dtype) + len(op))
    for incoming_first in (False, True):
        a, b = socket.socketpair()
        with a, b:
            mine, theirs = _operands(dtype, rng)
            head, _ = frame(WHOLE, theirs.tobytes(), step=1)
            b.sendall(head + theirs.tobytes())  # the partner's frame, there first
            acc, room = mine.copy(), memoryview(bytearray(len(head) + mine.nbytes))
            into = memoryview(acc).cast("B")
            found, sent, taken = native_swap(a.fileno(), head, bytes(into), room, 1.0, into,
                                             DTYPES[dtype].code, REDUCTION_CODES[op],
                                             incoming_first)  # fmt: skip
            assert (found, sent, taken) == (COMBINED_HERE, len(room), len(room))
            assert b.recv(len(room), socket.MSG_WAITALL) == head + mine.tobytes()  # its frame
        want = mine.copy()
        with np.errstate(all="ignore"):
            combine(DTYPES[dtype], op, want, theirs, incoming_first)
        if dtype.startswith("float") and op not in ("max", "min"):  # which NaN a sum of two
            both = np.isnan(mine) & np.isnan(theirs)  # keeps is the compiler's (kernels/_fold.h)
            assert np.isnan(acc[both]).all()
            acc[both] = want[both] = 0
        assert acc.tobytes() == want.tobytes(), (dtype, op, incoming_first)


@pytest.mark.skipif(native_swap is None, reason="asyncreduce.transport._stream_core was not built")
def test_only_what_c_combines_is_given_to_it() -> None:
    for dtype in ("float16", "bfloat16", "bool", "complex64", "complex128"):
        assert not native_combines(DTYPES[dtype].code, REDUCTION_CODES["sum"]), dtype
    assert not native_combines(DTYPES["float32"].code, REDUCTION_CODES["band"])  # (refused)
    with pytest.raises(ValueError, match="cannot combine"):
        native_swap(0, b"h" * 60, b"x" * 8, memoryview(bytearray(68)), 0.0,
                    memoryview(bytearray(8)), DTYPES["float16"].code, REDUCTION_CODES["sum"])
    room = memoryview(bytearray(68))
    with pytest.raises(ValueError, match="cannot combine"):
        native_swaps((0,), (room,), (1,), (False,), b"h" * 60, 8, b"x" * 8, 0.0,
                     memoryview(bytearray(8)), DTYPES["float16"].code, REDUCTION_CODES["sum"])
    with pytest.raises(ValueError, match="as many"):  # (and nothing sent: fd 0 is no socket)
        native_swaps((0, 0), (room,), (1, 2), (False, True), b"h" * 60, 8, b"x" * 8, 0.0)
    with pytest.raises(ValueError, match="does not fit"):
        native_swaps((0,), (room,), (1,), (False,), b"h" * 60, 8, b"x" * 9, 0.0)
    with pytest.raises(ValueError, match="its step at 58"):
        native_swaps((0,), (room,), (1,), (False,), b"h" * 60, 58, b"x" * 8, 0.0)


@pytest.mark.parametrize("native", TAKES)
def test_swap_sends_its_frame_then_takes_the_partners(native: bool) -> None:
    """``Transport.swap``: this rank's frame goes straight out, and the partner's, of the same
    header, is taken off the stream (combined, in C; else handed back to combine); not there
    yet: None, and ``take_frame`` looks again; what is not the frame: ELSEWHERE."""
    ta, sa, tb, sb = tcp_pair(native)
    mine, theirs = np.arange(256, dtype=np.float32), np.full(256, 0.5, np.float32)
    head, _ = frame(WHOLE, mine.tobytes(), step=1)
    how = Combining(memoryview(mine).cast("B"), DTYPES["float32"].code, REDUCTION_CODES["sum"])
    assert ta.swap(1, head, how.into, 0, 0.001, how, False) is None  # rank 1 has not sent
    how_b = Combining(memoryview(theirs).cast("B"), how.dtype, how.op)
    got = tb.swap(0, head, how_b.into, 0, 0.001, how_b, True)
    if native:
        assert got is COMBINED
    else:  # (the Python look hands the payload back, for numpy to combine)
        assert got is not None and got is not ELSEWHERE and got.tobytes() == mine.tobytes()
        theirs += np.frombuffer(got, np.float32)
    assert np.array_equal(theirs, np.arange(256) + 0.5)
    taken = ta.take_frame(1, head, mine.nbytes, 1.0) if native else None  # rank 0 takes 1's
    deadline = time.monotonic() + 5
    while taken is None and time.monotonic() < deadline:
        taken = ta.take_frame(1, head, mine.nbytes)
    assert taken is not None and np.array_equal(np.frombuffer(taken, np.float32), theirs - mine)
    assert all(token is None for token in sa.sent + sb.sent)  # (no token: maybe not told)
    assert not sa.frames and not sb.frames
    # a frame of another step first: not this one; poll reads it
    other, _ = frame(WHOLE, mine.tobytes(), step=2)
    tb.send(0, other, memoryview(mine.tobytes()), 0, "other")
    assert ta.swap(1, head, how.into, 0, 0.05, how, False) is ELSEWHERE
    pump(ta, tb, until=lambda: len(sa.frames) == 1 and len(sb.frames) == 1)
    assert sa.frames[0][1].step == 2 and sb.frames[0][1].step == 1  # (and the swap's frame)
    ta.close()
    tb.close()


@pytest.mark.parametrize("native", TAKES)
@pytest.mark.parametrize("ahead", ["both", "first", "another"])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_swaps_run_step_after_step_and_stop_where_one_does_not_end_well(
    native: bool, ahead: str, op: str
) -> None:
    """``Transport.swaps``: each step sends the buffer as the step before left it, with its
    own step in the header, and combines the partner's frame of that step, all in one call
    into C; the partner's second frame not there yet: (1, None); its frame of another
    operation there instead: (1, ELSEWHERE), and poll reads that. The Python look stops at
    the first step with the frame, for numpy to combine (the engine goes on message by
    message). The partner here sends its frames ahead, so one process runs both sides. Max
    of signed zeros and NaNs gives other bits in the other order: each step's own."""
    ta, sa, tb, sb = tcp_pair(native)
    f32 = DTYPES["float32"]
    steps = (Swap(1, 1, True), Swap(1, 2, False))  # (the peer's operand first, then ours)
    nan = np.float32("nan")
    signed = np.array([0.0, -0.0, nan, -nan] * 16, np.float32)  # (max: the first of equals)
    mine = np.arange(64, dtype=np.float32) if op == "sum" else signed.copy()
    start = mine.copy()
    theirs = [np.full(64, 0.25, np.float32), np.full(64, 3.0, np.float32)]
    if op == "max":
        theirs = [-signed, signed.copy()]
    head, _ = frame(WHOLE, mine.tobytes(), step=1)
    tb.send_now(0, head, memoryview(theirs[0]), 0)
    if ahead == "both":
        tb.send_now(0, with_step(head, 2), memoryview(theirs[1]), 0)
    elif ahead == "another":
        tb.send_now(0, frame(b"another", mine.tobytes(), step=2)[0], memoryview(mine), 0)
    how = Combining(memoryview(mine).cast("B"), f32.code, REDUCTION_CODES[op])
    done, view = ta.swaps(steps, head, how.into, 0, 0.05, how)
    if not native:  # (the frame handed back at the first step, as swap hands it back)
        assert done == 0 and view is not None and view is not ELSEWHERE
        assert view.tobytes() == theirs[0].tobytes()
        pump(ta, tb, until=lambda: len(sb.frames) == 1)
        assert sb.frames[0][1].step == 1 and sb.frames[0][2] == start.tobytes()
        ta.close()
        tb.close()
        return
    want = {"both": (2, COMBINED), "first": (1, None), "another": (1, ELSEWHERE)}[ahead]
    assert (done, view) == want
    after = [start.copy()]  # the buffer after each step, as numpy combines it
    for step, (_, _, incoming_first) in enumerate(steps[:done]):
        after.append(after[-1].copy())
        combine(f32, op, after[-1], theirs[step], incoming_first)
    assert mine.tobytes() == after[done].tobytes()
    if op == "max":  # (which the other order would not give)
        flipped = start.copy()
        combine(f32, op, flipped, theirs[0], not steps[0].incoming_first)
        assert flipped.tobytes() != after[1].tobytes()
    pump(ta, tb, until=lambda: len(sb.frames) == 2)  # the buffer as each step found it:
    (_, h1, p1), (_, h2, p2) = sb.frames
    assert (h1.step, h2.step) == (1, 2) and h1.name == h2.name == WHOLE
    assert p1 == after[0].tobytes() and p2 == after[1].tobytes()
    if ahead == "another":
        pump(ta, tb, until=lambda: len(sa.frames) == 1)
        assert sa.frames[0][1].name == b"another"
    ta.close()
    tb.close()


@pytest.mark.parametrize("native", TAKES)
def test_a_swap_whose_frame_does_not_leave_whole_sends_the_buffer_as_it_was(native: bool) -> None:
    """A swap sends the caller's buffer itself, which changes as soon as the swap returns:
    what did not fit the socket is queued as a copy, so the partner gets the buffer as it
    was, and ELSEWHERE says the run cannot go on directly."""
    ta, sa, tb, sb = tcp_pair(native)
    big = np.random.default_rng(5).integers(0, 255, 32 << 20, dtype=np.uint8)
    want = big.tobytes()
    head, _ = frame(b"op", want, step=1)
    assert ta.swap(1, head, memoryview(big), 0, 0.001) is ELSEWHERE
    assert not ta.quiet(1, 64)
    big[:] = 7  # (the run goes on: the buffer changes)
    pump(ta, tb, until=lambda: len(sb.frames) == 1)
    assert sb.frames[0][2] == want and not sb.lost
    ta.close()
    tb.close()


@pytest.mark.skipif(native_swap is None, reason="asyncreduce.transport._stream_core was not built")
def test_swap_leaves_what_does_not_lie_at_whole_elements_to_its_caller() -> None:
    """C combines whole elements only where both the buffer and the partner's payload lie at
    a multiple of their size; a name of odd length, or an array that starts off one, gets
    the frame back uncombined (FRAME), which the caller combines with numpy."""
    code, add = DTYPES["float64"].code, REDUCTION_CODES["sum"]
    for name, offset in ((b"odd", 0), (b"8 bytes!", 0), (b"8 bytes!", 1)):
        a, b = socket.socketpair()
        with a, b:
            raw = bytearray(8 * 32 + 8)
            acc = np.frombuffer(raw, np.float64, 32, offset=offset)  # (writable, maybe off)
            acc[:] = 1.0
            theirs = np.full(32, 2.0)
            head, _ = frame(name, theirs.tobytes(), step=1)
            b.sendall(head + theirs.tobytes())
            room = memoryview(bytearray(len(head) + 256))
            into = memoryview(acc).cast("B")
            found, _, _ = native_swap(a.fileno(), head, bytes(into), room, 1.0, into, code, add)
        whole = len(head) % 8 == 0 and offset == 0
        assert found == (COMBINED_HERE if whole else FRAME_HERE), (name, offset)
        assert np.all(acc == (3.0 if whole else 1.0))
