"""A run's metadata JSON checked and kept compact (PROTOCOL.md 2, ``metadata`` frames).

Apart from the sink because it is a codec, not a rule of the run: text in, MessagePack out
or :class:`~broker.run.events.Rejected`. The sink keeps the result and decodes it per header.
"""
from __future__ import annotations

import json

import msgspec

from broker.run.events import Rejected

__all__ = ["parse_metadata"]

_pack = msgspec.msgpack.Encoder().encode
_fast = msgspec.json.Decoder().decode


def _int_or_float(text: str) -> int | float:
    value = int(text)
    return value if -(2**63) <= value < 2**64 else float(value)


def parse_metadata(text: str) -> msgspec.Raw:
    """The metadata JSON as MessagePack bytes (in a :class:`msgspec.Raw`), or
    :class:`Rejected` (``bad_metadata_json``) when it is malformed.

    Kept encoded, not parsed: 1 MiB of JSON such as ``[{}, {}, ...]`` parses into ~25 MB
    of Python objects, per run (x ``--max-runs``), while its MessagePack is smaller than the
    text; a header decodes it for the moment it is encoded (transient, and headers are
    coalesced). Contract v3: JSON whose strings cannot be encoded as UTF-8 is malformed too
    (``json.loads`` turns a ``\\udc00`` escape into a lone surrogate no encoder can write: the
    run's events and snapshot would be lost to every web that connects later); encoding
    here finds it. Integers beyond MessagePack's range become floats, as the server does.

    Standard JSON is parsed by msgspec first (~7x faster than ``json.loads``: 1 MiB of small
    numbers in ~4 ms rather than ~25 ms, and the broker parses on its only thread, so a
    flood of such frames delays every other run by this much a frame); anything it refuses
    (``NaN``, ``1e999``, a lone surrogate, huge integers, malformed text) takes the
    ``json.loads`` path below, so what is accepted, and how, is unchanged."""
    try:
        return msgspec.Raw(_pack(_fast(text)))
    except (msgspec.DecodeError, RecursionError, OverflowError, UnicodeEncodeError):
        pass
    try:
        parsed = json.loads(text)
        try:
            return msgspec.Raw(_pack(parsed))
        except OverflowError:
            return msgspec.Raw(_pack(json.loads(text, parse_int=_int_or_float)))
    except UnicodeEncodeError:
        raise Rejected("bad_metadata_json", "a string is not UTF-8 (lone surrogate)") from None
    except (ValueError, RecursionError) as exc:  # RecursionError: absurd nesting
        raise Rejected("bad_metadata_json", str(exc)[:200]) from None
