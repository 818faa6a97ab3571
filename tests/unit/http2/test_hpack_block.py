"""The stateless HPACK encoder (http2/hpack_block.py BlockEncoder) against two decoders."""

from __future__ import annotations

import hpack
from hypothesis import given
from hypothesis import strategies as st

from ambient_mesh.http2.hpack_block import BlockDecoder, BlockEncoder

_names = st.one_of(
    st.sampled_from([b":method", b":authority", b":status", b"baggage", b"traceparent", b"forwarded"]),
    st.binary(min_size=1, max_size=300).map(lambda b: bytes(c % 26 + 97 for c in b)),
)
_fields = st.lists(st.tuples(_names, st.binary(max_size=300)), max_size=20)


@given(_fields)
def test_any_header_list_decodes_to_itself_with_ours_and_the_hpack_library(headers):
    block = BlockEncoder().encode(headers)
    assert BlockDecoder(max_list_bytes=1 << 20).decode(block) == headers
    assert hpack.Decoder().decode(block, raw=True) == headers


def test_static_fields_are_one_octet_and_nothing_is_huffman_coded_or_indexed():
    enc = BlockEncoder()
    assert enc.encode([(b":status", b"200")]) == b"\x88"  # RFC 7541 Appendix A index 8
    block = enc.encode([(b":method", b"CONNECT"), (b"traceparent", b"00-ab")])
    # :method by static name index 2, literal without indexing; new-name literal; H bit clear.
    assert block == b"\x02\x07CONNECT" + b"\x00\x0btraceparent\x0500-ab"
    decoder = BlockDecoder(max_list_bytes=4096)
    decoder.decode(block)
    assert len(decoder.table.dynamic_entries) == 0  # the peer's table is never touched


def test_a_peer_table_size_of_zero_needs_nothing_from_the_encoder():
    enc = BlockEncoder()
    enc.set_table_size(0)
    assert hpack.Decoder(max_header_list_size=1 << 20).decode(enc.encode([(b"a", b"b")]), raw=True) == [
        (b"a", b"b")
    ]
