"""Pure Server-Sent Events formatting (byte-exact, no I/O).

The hub encodes every feed event exactly once with :func:`event` and pushes the same bytes
to every subscribed client, so the formatting lives here as small pure functions that the
tests pin byte for byte (the way sse-starlette's ``event.py`` is tested).

Rules of the text/event-stream format that matter here:

* a field is ``name: value\\n``; an event ends with a blank line;
* ``data`` may span lines: every line becomes its own ``data:`` line (``\\r\\n``, ``\\r`` and
  ``\\n`` all end a line), so a payload can never smuggle in a field or end the event early;
* ``id`` and ``event`` are single-line fields: CR and LF are stripped from them (and NUL from
  ``id``, which browsers would otherwise ignore the whole field for);
* a line starting with ``:`` is a comment, which browsers ignore (our keep-alive ping).
"""
from __future__ import annotations

import re
from typing import Any, Union

from web import piecewise

#: Line terminators of the event-stream grammar.
_LINE_SPLIT = re.compile(r"\r\n|\r|\n")
_SINGLE_LINE = str.maketrans("", "", "\r\n")

#: A keep-alive comment; browsers ignore it, proxies see traffic, and a write to a dead
#: client fails (pywsgi only notices a gone client on a failed write).
PING = b": ping\n\n"


def _single_line(value: object) -> str:
    return str(value).translate(_SINGLE_LINE)


def event(
    data: str | None = None,
    *,
    event: str | None = None,
    id: Union[int, str, None] = None,  # noqa: A002 - the SSE field is called "id"
    retry: int | None = None,
    comment: str | None = None,
) -> bytes:
    """Format one SSE event as UTF-8 bytes, ending with the blank line that dispatches it.

    Fields appear in the order comment, id, event, retry, data. ``data=""`` sends one empty
    ``data:`` line (an event with empty data); ``data=None`` sends none.
    """
    lines: list[str] = []
    if comment is not None:
        lines.extend(": " + part for part in _LINE_SPLIT.split(comment))
    if id is not None:
        lines.append("id: " + _single_line(id).replace("\0", ""))
    if event is not None:
        lines.append("event: " + _single_line(event))
    if retry is not None:
        lines.append(f"retry: {int(retry)}")
    if data is not None:
        lines.extend("data: " + part for part in _LINE_SPLIT.split(data))
    return ("\n".join(lines) + "\n\n").encode("utf-8")


def retry(milliseconds: int) -> bytes:
    """The reconnection delay line sent first on every stream: ``retry: <ms>``."""
    return b"retry: %d\n\n" % int(milliseconds)


def comment(text: str) -> bytes:
    """A comment (``: text``); each line of ``text`` becomes its own comment line."""
    return event(comment=text)


def json_event(kind: str, seq: int, payload: Any) -> bytes:
    """An event whose data is ``payload`` as compact JSON (non-finite floats become null).

    Compact JSON never contains a raw CR or LF (msgspec escapes them inside strings), so the
    data is always a single ``data:`` line: the bytes are assembled around the encoder's
    output as they are, exactly what :func:`event` writes for it, without decoding,
    splitting and re-encoding a payload that may be megabytes (a 65,536-rank ``ranks``
    event). ``kind`` is one of the hub's own event names; it is still made single-line.
    A big list is encoded in pieces (:func:`web.piecewise.encode_json`, the same bytes), so
    a thread encoding it off the loop lets the GIL go between them.
    """
    body = piecewise.encode_json(payload)
    if b"\r" in body or b"\n" in body:  # cannot happen with msgspec; kept exact if it did
        return event(body.decode("utf-8"), event=kind, id=seq)
    return b"".join((b"id: %d\nevent: " % int(seq), _single_line(kind).encode("utf-8"),
                     b"\ndata: ", body, b"\n\n"))
