"""Decoding and encoding big feed values in pieces, so a thread doing it lets the GIL go.

Why (issue 38, item 2): the web moves the big work of a feed message off its event loop into
gevent's thread pool (:attr:`web.hub.Hub.offload`), but one C call holds the GIL from start
to end: ``msgspec`` decoding a 9 MiB ``ranks`` message of a 65,536-rank run is one call of
~50 ms (seconds on a loaded machine), and the loop thread waits for it whatever thread makes
it. Split into calls of at most :data:`PIECE_BYTES` each, the thread gives the GIL back
between two of them (CPython's switch interval, 5 ms), so the loop answers meanwhile.

* :func:`decode` is ``msgspec.msgpack.Decoder().decode`` for any value: a big array or map is
  first split into its items' raw bytes (:class:`msgspec.Raw`, no decoding), then each item
  decoded on its own, recursively, so the result is equal to a whole decode.
* :func:`encode_json` is ``msgspec.json.Encoder().encode`` for any value: a big list, or a
  dict holding big lists, is encoded a slice of items at a time and the pieces joined; the
  bytes are the same as a whole encode's (compact JSON: ``[a,b]`` is ``[a]`` and ``[b]``
  without their brackets, joined by a comma).

Pure: no I/O, no threads of its own.
"""
from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["PIECE_BYTES", "PIECE_ITEMS", "decode", "encode_json"]

#: A msgpack value of at most this many bytes is decoded in one call.
PIECE_BYTES = 64 * 1024
#: A list of more items than this is JSON-encoded this many items at a time.
PIECE_ITEMS = 1024

_decode_any = msgspec.msgpack.Decoder().decode
_decode_array = msgspec.msgpack.Decoder(list[msgspec.Raw]).decode
_decode_map = msgspec.msgpack.Decoder(dict[Any, msgspec.Raw]).decode
_json = msgspec.json.Encoder().encode
#: msgpack's first byte of an array (fixarray, array 16, array 32) and of a map
_ARRAY_FIRST = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}
_MAP_FIRST = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


def decode(data: bytes | memoryview | msgspec.Raw) -> Any:
    """``data`` decoded as MessagePack (any value), in pieces of at most about
    :data:`PIECE_BYTES` (module docstring); :class:`msgspec.DecodeError` as a whole decode's."""
    # a Raw is a view of its parent's bytes (the buffer protocol): decoded as it is, never
    # copied first (a copy at each level of a big value tripled a run snapshot's peak)
    raw = memoryview(data) if isinstance(data, msgspec.Raw) else data
    if len(raw) <= PIECE_BYTES:
        return _decode_any(raw)
    first = raw[0]
    if first in _ARRAY_FIRST:
        return [decode(item) for item in _decode_array(raw)]
    if first in _MAP_FIRST:
        return {key: decode(value) for key, value in _decode_map(raw).items()}
    return _decode_any(raw)


def _list_json(items: list[Any]) -> bytes:
    if len(items) <= PIECE_ITEMS:
        return _json(items)
    pieces = [_json(items[i:i + PIECE_ITEMS])[1:-1] for i in range(0, len(items), PIECE_ITEMS)]
    return b"[" + b",".join(pieces) + b"]"


def encode_json(value: Any) -> bytes:
    """``value`` as compact JSON, byte for byte what ``msgspec.json.Encoder().encode`` writes,
    a list (top-level, or a top-level dict's value) encoded :data:`PIECE_ITEMS` items at a
    time (module docstring)."""
    if isinstance(value, list):
        return _list_json(value)
    if isinstance(value, dict) and any(isinstance(v, list) and len(v) > PIECE_ITEMS
                                       for v in value.values()):
        if not all(isinstance(k, str) for k in value):
            return _json(value)
        parts = [_json(k) + b":" + (_list_json(v) if isinstance(v, list) else _json(v))
                 for k, v in value.items()]
        return b"{" + b",".join(parts) + b"}"
    return _json(value)
