"""MeshQuicConnection skips a PADDING run as aioquic does, without a Python loop per byte."""

from aioquic.buffer import Buffer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from hypothesis import given, strategies as st

from meshd.transport.quic import MeshQuicConnection


def _connection() -> MeshQuicConnection:
    return MeshQuicConnection(configuration=QuicConfiguration(is_client=True))


def _skip(handler, conn, data: bytes, start: int) -> int:
    buf = Buffer(data=data)
    buf.seek(start)
    handler(conn, None, 0x00, buf)
    return buf.tell()


@given(st.binary(max_size=64), st.integers(0, 3000), st.binary(max_size=64))
def test_padding_ends_where_aioquic_ends_it(before, zeros, after):
    """The run of zero bytes after the frame type is consumed up to the first other byte or the end."""
    data = before + bytes(zeros) + after
    conn = _connection()
    ours = _skip(MeshQuicConnection._handle_padding_frame, conn, data, len(before))
    assert ours == _skip(QuicConnection._handle_padding_frame, conn, data, len(before))
    assert ours == len(before) + zeros + len(after) - len(after.lstrip(b"\x00"))


def test_a_full_datagram_of_padding_is_consumed_to_its_end():
    """A client Initial on loopback is padded to 16,000 bytes: all of it is skipped."""
    assert _skip(MeshQuicConnection._handle_padding_frame, _connection(), bytes(16000), 1) == 16000
