"""Float columns from a ``steps`` frame's lists, in one C pass where possible.

Split from :mod:`broker.run.steps.columns` (which closes steps) because these two are the
conversion, not the closing: :func:`opt_floats` (floats and ``None``, the nulls found only
when there is a NaN) and :func:`list_floats` (many short float lists read in place from
their MessagePack encoding, issue 17).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, Tuple

import msgspec
import numpy as np

__all__ = ["opt_floats", "list_floats"]

# ------------------------------------------------------------------ array helpers


def opt_floats(values: Iterable[Any], count: int,
                listed: Optional[Callable[[], List[Any]]] = None
                ) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """``count`` values (floats and ``None``) as float64, and which are not ``None`` (None:
    all are). One C pass (``np.fromiter``, which makes ``None`` NaN); only when there is a
    NaN are the values listed again (``listed()``, or ``values`` when it is a list) and the
    NaN positions looked at (a value that really is NaN is one of them)."""
    arr = np.fromiter(values, np.float64, count)
    nan = np.flatnonzero(arr != arr)
    if not len(nan):
        return arr, None
    seq = values if isinstance(values, list) else listed() if listed is not None else []
    idx = nan.tolist()
    gone = [i for i, v in zip(idx, map(seq.__getitem__, idx)) if v is None]
    if not gone:
        return arr, None
    has = np.ones(len(arr), dtype=bool)
    has[gone] = False
    return arr, has


_pack = msgspec.msgpack.Encoder().encode
#: one MessagePack float64: the ``0xcb`` tag, then the value big-endian
_FLOAT_DTYPE = np.dtype([("t", "u1"), ("v", ">f8")])


def list_floats(lists: List[Any], k: int) -> Optional[np.ndarray]:
    """The values of ``lists`` (each a list of ``k`` values, 1 <= k <= 15; ``k`` = 0:
    ``lists`` is itself a list of values) concatenated, as float64, or None when some value
    is not a float (``None``, an int): then the caller converts them one by one.

    Why: a ``steps`` frame's metric values are one Python list per name, so a close of
    1,024 one-point frames x 4 names has 4,096 lists of one float; iterating them
    (``chain``) cost ~55 ns a value, 4x what converting a flat list costs. Encoded at once
    (C, ~12 ns a value), the lists are fixed-size MessagePack records (``0x90|k``, then
    ``0xcb`` + a big-endian float64 per value) that numpy reads in place. The layout is
    checked, not assumed: the total length and every header and tag byte (no other
    MessagePack value of a float list is 9 bytes with an ``0xcb`` tag), each with a bytes
    slice and count (C, a third of what the same checks cost as numpy calls), but for each
    list's header and first tag, one two-byte compare."""
    n = len(lists)
    if not n or not 0 <= k <= 15:
        return None
    try:
        buf = _pack(lists)
    except (TypeError, OverflowError):  # (values of a frame built in code, not decoded)
        return None
    size = 1 + 9 * k if k else 9
    head = 1 if n <= 15 else 3 if n <= 0xFFFF else 5
    if len(buf) != head + n * size:
        return None
    if not k:
        if buf[head::9].count(b"\xcb") != n:
            return None
        return np.frombuffer(buf, _FLOAT_DTYPE, n, head)["v"].astype(np.float64)
    # each list's header and first tag as one little-endian uint16 (one strided compare
    # where a bytes slice and count per byte position cost twice as much), then the tags
    # of its other values
    if not (np.ndarray((n,), "<u2", buf, head, (size,)) == _HEAD_TAG[k]).all():
        return None
    for j in range(head + 10, head + size, 9):
        if buf[j::size].count(b"\xcb") != n:
            return None
    return np.ndarray((n, k), ">f8", buf, head + 2, (size, 9)).astype(np.float64).ravel()


#: the MessagePack header of a list of k values (k <= 15) and the float64 tag after it,
#: read as a little-endian uint16
_HEAD_TAG = [(0xcb << 8) | 0x90 | k for k in range(16)]
