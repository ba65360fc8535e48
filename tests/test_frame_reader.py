"""FrameReader, sans-IO: bytes in (cut anywhere), the same frames out, payloads where we say.

No socket: the test is the reader's owner. It receives a stream of packed frames in pieces
of random sizes, lands each payload in a buffer of its own (or takes it where it lies), and
must get back exactly the frames that were packed.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncreduce.transport.frame import (
    DATA,
    ERROR,
    HEADER,
    Descriptor,
    FrameError,
    FrameReader,
    pack_header,
)

DESC = Descriptor(1, 2, 1, 0, 10)


def stream(frames: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join(
        pack_header(DATA, name, i, 0, 0, len(payload), DESC) + payload
        for i, (name, payload) in enumerate(frames)
    )


def read_all(
    reader: FrameReader, data: bytes, cuts: list[int], take_views: bool
) -> list[tuple[bytes, int, bytes, str]]:
    """Feed ``data`` in pieces (sizes from ``cuts``); return (name, instance, payload, path)."""
    got: list[tuple[bytes, int, bytes, str]] = []
    pos, turn = 0, 0
    while pos < len(data):
        room = reader.room()
        n = min(len(room), len(data) - pos, max(1, cuts[turn % len(cuts)]))
        turn += 1
        room[:n] = data[pos : pos + n]
        pos += n
        if reader.payload is not None:
            if reader.received(n):
                header = reader.header
                assert header is not None
                got.append((header.name, header.instance, bytes(reader.finish()), "landed"))
            continue
        reader.received(n)
        while (header := reader.next_header()) is not None:
            size = header.payload_len
            staged = reader.staged_payload(size) if take_views and size else None
            if staged is not None:
                got.append((header.name, header.instance, bytes(staged), "view"))
                reader.skip(size)
            elif reader.land(memoryview(bytearray(size))):
                got.append((header.name, header.instance, bytes(reader.finish()), "landed"))
    return got


@settings(max_examples=200, deadline=None)
@given(
    frames=st.lists(
        st.tuples(st.binary(min_size=1, max_size=20), st.binary(max_size=300)), max_size=12
    ),
    cuts=st.lists(st.integers(1, 400), min_size=1, max_size=8),
    take_views=st.booleans(),
)
def test_any_cut_of_the_stream_gives_back_the_same_frames(
    frames: list[tuple[bytes, bytes]], cuts: list[int], take_views: bool
) -> None:
    reader = FrameReader(256)  # small staging: payloads past it are landed, not staged
    got = read_all(reader, stream(frames), cuts, take_views)
    assert [(name, i, payload) for name, i, payload, _ in got] == [
        (name, i, payload) for i, (name, payload) in enumerate(frames)
    ]
    assert reader.between_frames()


def test_a_small_frame_received_whole_is_taken_where_it_lies() -> None:
    """The view path: a payload that arrived with its header in one receive is offered as a
    view of the staging buffer itself (no copy, no buffer of its own), and skipped after."""
    reader = FrameReader(1024)
    data = stream([(b"a", b"payload-one"), (b"b", b"two")])
    got = read_all(reader, data, [len(data)], take_views=True)
    assert got == [(b"a", 0, b"payload-one", "view"), (b"b", 1, b"two", "view")]
    reader.room()[: len(data)] = data
    reader.received(len(data))
    header = reader.next_header()
    assert header is not None
    view = reader.staged_payload(header.payload_len)
    assert view is not None and view.obj is reader.room().obj  # the staging buffer itself
    assert read_all(FrameReader(1024), data, [len(data)], take_views=False)[0][3] == "landed"


def test_a_payload_lands_in_the_buffer_given_and_the_rest_is_received_into_it() -> None:
    reader = FrameReader(1024)
    payload = bytes(range(256)) * 16
    data = pack_header(DATA, b"op", 7, 0, 0, len(payload), DESC) + payload
    first = HEADER.size + 2 + 100
    reader.room()[:first] = data[:first]
    reader.received(first)
    header = reader.next_header()
    assert header is not None and header.name == b"op" and header.key == (b"op", 7)
    assert reader.staged_payload(len(payload)) is None  # not all of it is here
    dest = memoryview(bytearray(len(payload)))
    assert not reader.land(dest)
    room = reader.room()
    assert room.obj is dest.obj and len(room) == len(payload) - 100  # zero copy: straight in
    room[:] = data[first:]
    assert reader.received(len(room))
    landed = reader.finish()
    assert landed is dest and bytes(landed) == payload
    assert reader.between_frames()


def test_divert_moves_the_rest_of_a_payload_out_of_the_buffer_given() -> None:
    reader = FrameReader(1024)
    data = pack_header(DATA, b"op", 0, 0, 0, 8, DESC) + b"abcdefgh"
    reader.room()[: HEADER.size + 2 + 3] = data[: HEADER.size + 2 + 3]
    reader.received(HEADER.size + 2 + 3)
    assert reader.next_header() is not None
    dest = memoryview(bytearray(8))
    reader.land(dest)
    reader.divert()
    room = reader.room()
    room[:] = data[-5:]
    assert reader.received(5)
    payload = reader.finish()
    assert payload is not dest and bytes(dest[:3]) == b"abc" and bytes(dest[3:]) == bytes(5)


def test_a_bad_header_is_refused_before_anything_trusts_it() -> None:
    reader = FrameReader(1024)
    bad = bytearray(pack_header(ERROR, b"op", 0, 0, 0, 1 << 40, DESC))
    reader.room()[: len(bad)] = bad
    reader.received(len(bad))
    with pytest.raises(FrameError, match="payload of"):
        reader.next_header()
