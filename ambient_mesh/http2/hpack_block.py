"""HPACK (RFC 7541) header blocks: a decoder linear in the block size, and the encoder.

Counterpart: the `hpack` library's Decoder, whose `decode` copies the rest of the block
(`memoryview.tobytes()`) for every literal it meets, so a block of n bytes costs O(n^2): with
1 MiB frames and CONTINUATION a 16 MiB block froze the event loop for 21 s (issue 8). This
decoder walks the block once with an integer offset and copies only the names and values it
returns. The tables (static + dynamic, eviction) and the Huffman code are the library's
(`hpack.table.HeaderTable`, `hpack.huffman_table.decode_huffman`); encoding uses
our own stateless encoder (below): we only ever encode our own small header lists, and
`hpack.Encoder` Huffman-coded and table-indexed each CONNECT's fresh `traceparent` in pure
Python, about a quarter of the outbound proxy's per-connection CPU
(docs/performance.md, "HTTP/2: a purpose-built sans-IO core").

The caller bounds the block's size before it gets here (connection.py); this module bounds the
decoded header list (RFC 9113 6.5.2 SETTINGS_MAX_HEADER_LIST_SIZE, counted as RFC 7541 4.1
entry sizes: name + value + 32) and stops at the first field that passes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import hpack
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

from ..errors import ProtocolError

# RFC 7541 4.1: every entry costs its name, its value and 32 octets of overhead.
ENTRY_OVERHEAD_BYTES = 32
# RFC 9113 6.5.2: SETTINGS_HEADER_TABLE_SIZE default; we never advertise another value.
DEFAULT_TABLE_BYTES = 4096
# Integers wider than this many continuation octets are refused (RFC 7541 5.1 lets us choose).
MAX_INTEGER_OCTETS = 5
# RFC 7541 Appendix A, indexed from 1 (entry 0 is never referenced: index 0 is an error).
_STATIC_BY_INDEX: tuple[tuple[bytes, bytes], ...] = ((b"", b""), *HeaderTable.STATIC_TABLE)
_STATIC_ENTRIES = len(HeaderTable.STATIC_TABLE)


class HpackError(ProtocolError):
    """A header block that does not decode (RFC 9113 4.3: a connection error, COMPRESSION_ERROR)."""


class HeaderListTooLarge(HpackError):
    """The decoded list passes the SETTINGS_MAX_HEADER_LIST_SIZE we advertised."""


class BlockDecoder:
    """Decodes complete header blocks for one connection (the dynamic table is shared)."""

    __slots__ = ("table", "max_table_bytes", "max_list_bytes")

    def __init__(self, *, max_list_bytes: int, max_table_bytes: int = DEFAULT_TABLE_BYTES) -> None:
        self.table = HeaderTable()
        self.table.maxsize = max_table_bytes
        self.max_table_bytes = max_table_bytes
        self.max_list_bytes = max_list_bytes

    def decode(self, data: bytes) -> list[tuple[bytes, bytes]]:
        """The header list of `data` (a block), in order. Raises HpackError (or HeaderListTooLarge)."""
        # The common representations are decoded inline (issue 11, per connection: a CONNECT's
        # five fields cost 17 `_integer`, 10 `_string` and 6 `_literal` calls): an integer that
        # fits its prefix (one octet, RFC 7541 5.1) and a string literal without Huffman coding
        # and shorter than 127 octets (5.2). Anything else takes `_integer` / `_literal`, which
        # also raise for what is truncated or malformed.
        # One function with the error translation around the loop: a call per block fewer.
        try:
            table = self.table
            static = _STATIC_BY_INDEX
            headers: list[tuple[bytes, bytes]] = []
            list_bytes = 0
            pos = 0
            end = len(data)
            while pos < end:
                first = data[pos]
                if first & 0x80:  # 6.1 indexed field
                    index = first & 0x7F
                    if index == 0x7F:
                        index, pos = self._integer(data, pos, 7)
                    else:
                        pos += 1
                    if index == 0:
                        raise HpackError("HPACK indexed field with index 0")
                    if index <= _STATIC_ENTRIES:
                        name, value = static[index]
                    else:
                        name, value = table.get_by_index(index)
                elif first & 0x20 and not first & 0x40:  # 6.3 dynamic table size update
                    if headers:
                        raise HpackError("HPACK table size update after the first field (RFC 7541 4.2)")
                    size, pos = self._integer(data, pos, 5)
                    if size > self.max_table_bytes:
                        raise HpackError(f"HPACK table size {size} above the {self.max_table_bytes} allowed")
                    table.maxsize = size
                    continue
                else:
                    # 6.2.1 literal with incremental indexing (6-bit name index), or 6.2.2 / 6.2.3
                    # without indexing / never indexed (4-bit name index).
                    indexing = first & 0x40
                    mask = 0x3F if indexing else 0x0F
                    index = first & mask
                    if index == mask:
                        name, value, pos = self._literal(data, pos, 6 if indexing else 4)
                    else:
                        pos += 1
                        if index:
                            name = (
                                static[index][0] if index <= _STATIC_ENTRIES else table.get_by_index(index)[0]
                            )
                        elif pos < end and data[pos] < 0x7F:  # H = 0 and the length fits the prefix
                            stop = pos + 1 + data[pos]
                            if stop > end:
                                raise HpackError("HPACK string longer than the header block")
                            name = data[pos + 1 : stop]
                            pos = stop
                        else:
                            name, pos = self._string(data, pos)
                        if pos < end and data[pos] < 0x7F:
                            stop = pos + 1 + data[pos]
                            if stop > end:
                                raise HpackError("HPACK string longer than the header block")
                            value = data[pos + 1 : stop]
                            pos = stop
                        else:
                            value, pos = self._string(data, pos)
                    if indexing:
                        table.add(name, value)
                list_bytes += len(name) + len(value) + ENTRY_OVERHEAD_BYTES
                if list_bytes > self.max_list_bytes:
                    raise HeaderListTooLarge(
                        f"header list larger than the {self.max_list_bytes} bytes advertised "
                        "(SETTINGS_MAX_HEADER_LIST_SIZE)"
                    )
                headers.append((name, value))
            return headers
        except HpackError:
            raise
        except (hpack.HPACKError, IndexError, ValueError) as e:
            raise HpackError(f"HPACK header block does not decode: {e}") from None

    @staticmethod
    def _integer(data: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
        """RFC 7541 5.1; returns (value, position after it)."""
        mask = (1 << prefix_bits) - 1
        value = data[pos] & mask
        pos += 1
        if value < mask:
            return value, pos
        shift = 0
        for _ in range(MAX_INTEGER_OCTETS):
            if pos >= len(data):
                raise HpackError("HPACK integer truncated")
            octet = data[pos]
            pos += 1
            value += (octet & 0x7F) << shift
            if not octet & 0x80:
                return value, pos
            shift += 7
        raise HpackError(f"HPACK integer longer than {MAX_INTEGER_OCTETS} continuation octets")

    def _string(self, data: bytes, pos: int) -> tuple[bytes, int]:
        """RFC 7541 5.2; one copy of just this string."""
        if pos >= len(data):
            raise HpackError("HPACK string truncated")
        huffman = data[pos] & 0x80
        length, pos = self._integer(data, pos, 7)
        stop = pos + length
        if stop > len(data):
            raise HpackError("HPACK string longer than the header block")
        raw = data[pos:stop]
        return (decode_huffman(raw) if huffman else raw), stop

    def _literal(self, data: bytes, pos: int, prefix_bits: int) -> tuple[bytes, bytes, int]:
        index, pos = self._integer(data, pos, prefix_bits)
        if index:
            name = self.table.get_by_index(index)[0]
        else:
            name, pos = self._string(data, pos)
        value, pos = self._string(data, pos)
        return name, value, pos


# RFC 7541 Appendix A, indexed from 1: whole fields (":status 200" is one octet) and names.
_STATIC_FIELD_INDEX: dict[tuple[bytes, bytes], int] = {}
_STATIC_NAME_INDEX: dict[bytes, int] = {}
for _i, (_name, _value) in enumerate(HeaderTable.STATIC_TABLE, start=1):
    _STATIC_FIELD_INDEX.setdefault((_name, _value), _i)
    _STATIC_NAME_INDEX.setdefault(_name, _i)
# The encoder's per-name entry: the static fields of that name (value -> the field's one-octet
# indexed representation, RFC 7541 6.1) and the octets that start a literal without indexing of
# that name (6.2.2: the static name index, or 0 and the name as a plain string literal). Names
# are ours (the shell's header lists), a handful; past this many an entry is worked out per use.
MAX_ENCODER_NAMES = 64
_NAME_ENTRIES: dict[bytes, tuple[dict[bytes, bytes] | None, bytes]] = {}
# RFC 7541 5.2 length octets of plain (H = 0) strings shorter than 2^7 - 1.
_SHORT_LENGTHS = tuple(bytes((n,)) for n in range(0x7F))


def _integer_bytes(value: int, prefix_bits: int, first: int) -> bytes:
    """RFC 7541 5.1: `value` with an N-bit prefix; `first` holds the pattern bits above it."""
    mask = (1 << prefix_bits) - 1
    if value < mask:
        return bytes((first | value,))
    out = bytearray((first | mask,))
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string_bytes(text: bytes) -> bytes:
    """RFC 7541 5.2 without Huffman (H = 0): the length, then the octets as they are."""
    return _integer_bytes(len(text), 7, 0) + text


def _name_entry(name: bytes) -> tuple[dict[bytes, bytes] | None, bytes]:
    fields = {
        value: _integer_bytes(index, 7, 0x80)
        for (field_name, value), index in _STATIC_FIELD_INDEX.items()
        if field_name == name
    }
    index = _STATIC_NAME_INDEX.get(name)
    start = _integer_bytes(index, 4, 0x00) if index is not None else b"\x00" + _string_bytes(name)
    entry = (fields or None, start)
    if len(_NAME_ENTRIES) < MAX_ENCODER_NAMES:
        _NAME_ENTRIES[name] = entry
    return entry


class BlockEncoder:
    """Encodes our own header lists without state: static-table references and literals
    "without indexing" (RFC 7541 6.1, 6.2.2), never Huffman-coded.

    Nothing goes into the dynamic table, so no table size the peer sets (SETTINGS_HEADER_TABLE_SIZE,
    even 0) can be exceeded, and no size update is ever owed (RFC 7541 4.2). Huffman is optional
    (5.2); the octets it would save on a CONNECT (about 30%) cost more CPU than they save.
    """

    __slots__ = ()

    def set_table_size(self, size: int) -> None:
        """The peer's SETTINGS_HEADER_TABLE_SIZE: any size fits an encoder that indexes nothing."""

    def encode(self, headers: Sequence[tuple[bytes, bytes]]) -> bytes:
        # One entry lookup per field and no Python call for values shorter than 127 octets
        # (issue 11, per connection: the CONNECT and its 200 cost 13 `_integer_bytes` and 10
        # `_string_bytes` calls).
        out: list[bytes] = []
        append = out.append
        entries = _NAME_ENTRIES
        short = _SHORT_LENGTHS
        for name, value in headers:
            entry = entries.get(name)
            if entry is None:
                entry = _name_entry(name)
            fields, start = entry
            if fields is not None:
                indexed = fields.get(value)
                if indexed is not None:
                    append(indexed)  # 6.1 indexed field
                    continue
            append(start)  # 6.2.2 literal without indexing: the name
            n = len(value)
            append(short[n] if n < 0x7F else _integer_bytes(n, 7, 0))
            append(value)
        return b"".join(out)
