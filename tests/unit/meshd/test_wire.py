"""Length-prefixed msgpack frames: round trips, limits, malformed input."""

import struct

import pytest
from hypothesis import given, strategies as st

from meshd.wire import FrameDecoder, FrameError, FrameTooLarge, encode_frame

values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)


@given(st.lists(values, min_size=1, max_size=5), st.integers(1, 7))
def test_frames_survive_any_split(objs, step):
    data = b"".join(encode_frame(o) for o in objs)
    decoder = FrameDecoder()
    out = []
    for i in range(0, len(data), step):
        decoder.feed(data[i : i + step])
        while True:
            ok, value = decoder.next_frame()
            if not ok:
                break
            out.append(value)
    assert out == objs
    assert decoder.buffered == 0


def test_oversized_frames_are_refused_both_ways():
    with pytest.raises(FrameTooLarge):
        encode_frame(b"x" * 2000, max_size=1000)
    decoder = FrameDecoder(max_size=1000)
    decoder.feed(struct.pack(">I", 1001))  # refused from the header alone
    with pytest.raises(FrameTooLarge, match="1001"):
        decoder.next_frame()


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # never-used msgpack byte
        b"\x92\x01",  # array of 2 with one element
        b"\xd4\x05\x00",  # extension type
        b"\x81\x01\x02",  # map with an integer key
        b"\x01\x02",  # trailing bytes after a value
    ],
)
def test_malformed_bodies_raise_frame_error(body):
    decoder = FrameDecoder()
    decoder.feed(struct.pack(">I", len(body)) + body)
    with pytest.raises(FrameError):
        decoder.next_frame()


def test_nested_bombs_are_refused_not_crashing():
    body = b"\x91" * 100_000 + b"\x00"
    decoder = FrameDecoder()
    decoder.feed(struct.pack(">I", len(body)) + body)
    with pytest.raises(FrameError):
        decoder.next_frame()


def test_container_lengths_are_bounded_by_the_frame_limit():
    body = b"\xdd" + struct.pack(">I", 10**6)  # array32 header claiming a million elements
    decoder = FrameDecoder(max_size=64)
    decoder.feed(struct.pack(">I", len(body)) + body)
    with pytest.raises(FrameError):
        decoder.next_frame()
