"""The control channel's framing: broker -> ranks requests for dumps (PROTOCOL.md section 2.5).

The contract leaves this framing to the project; here it is. A request travels on the
broker's **publish** socket (the one webs subscribe to) as a two-part message, like every
other feed message (``broker/feed.py``):

* part 1, the topic: ``b"!ctl:" + run + b"!"``. Agents subscribe to exactly their run's
  topic. The closing ``!`` matters because ZeroMQ subscriptions match prefixes: without it
  run ``a`` would also receive run ``a1``'s requests (run ids never contain ``!``, so the
  topic cannot be forged by a run name). Webs read the feed's ``!`` topics they know and
  ignore the others (``feed.decode_update`` returns None), so they never act on it;
* part 2, a MessagePack map (:class:`ControlRequest`): ``v`` (1), ``run``, ``request_id``
  (1-64 characters), ``kind`` (``"stacks"`` or ``"profile"``), ``ranks`` (a list of ranks,
  or nil for every rank), ``hz`` (1-250) and ``seconds`` (0.5-60; both ignored for
  ``stacks``). An agent checks ``run`` again after the topic and acts only when its rank is
  asked; a body it cannot decode is dropped and logged (rate-limited by its owner).

One type end to end: the web builds a :class:`ControlRequest` from a ``POST /stacks`` body
and encodes it once (:func:`encode_body`); the broker decodes those bytes with the type's
constraints (:func:`decode_body`) and forwards the very same bytes to the agents, which
decode them once more (they trust no one). The bounds and defaults below are the only
copy: the web's 400 messages quote them.

Only msgspec and the standard library are imported, so the broker (and, through
``broker/feed.py``, anything that speaks the feed) can encode requests without zmq.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional

import msgspec
from msgspec import Meta

from .protocol import MAX_REQUEST_ID, MAX_WORLD_SIZE, RunId

__all__ = [
    "CONTROL_PREFIX",
    "ControlRequest",
    "ControlError",
    "control_topic",
    "encode_body",
    "decode_body",
    "encode_request",
    "decode_request",
    "DEFAULT_HZ",
    "DEFAULT_SECONDS",
    "MIN_HZ",
    "MAX_HZ",
    "MIN_SECONDS",
    "MAX_SECONDS",
]

CONTROL_PREFIX = b"!ctl:"
_END = b"!"
#: Request bounds (PROTOCOL.md section 4, ``POST /stacks``).
MIN_HZ, MAX_HZ = 1, 250
MIN_SECONDS, MAX_SECONDS = 0.5, 60.0
#: What a profile request that names no ``hz`` or ``seconds`` gets.
DEFAULT_HZ = 100
DEFAULT_SECONDS = 5.0


class ControlError(ValueError):
    """A control message that does not have the documented shape."""


class ControlRequest(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False,
                     forbid_unknown_fields=False):
    """One request for dumps of a run's ranks (module docstring). Keyword-only: one
    spelling everywhere, no argument order to get wrong."""

    run: RunId
    request_id: Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID)]
    kind: Literal["stacks", "profile"]
    ranks: Optional[Annotated[list[Annotated[int, Meta(ge=0, lt=MAX_WORLD_SIZE)]],
                              Meta(min_length=1, max_length=MAX_WORLD_SIZE)]] = None
    hz: Annotated[int, Meta(ge=MIN_HZ, le=MAX_HZ)] = DEFAULT_HZ
    seconds: Annotated[float, Meta(ge=MIN_SECONDS, le=MAX_SECONDS)] = DEFAULT_SECONDS
    v: int = 1

    def asks(self, rank: int) -> bool:
        """Whether ``rank`` is one of the ranks asked (every rank when ``ranks`` is None)."""
        return self.ranks is None or rank in self.ranks


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ControlRequest)


def control_topic(run: str) -> bytes:
    """The topic an agent of ``run`` subscribes to (and nothing else matches it)."""
    return CONTROL_PREFIX + run.encode() + _END


def encode_body(req: ControlRequest) -> bytes:
    """The request's MessagePack body, as the web sends it to the broker and the broker
    forwards it. Not checked here: msgspec checks the constraints when decoding, and every
    receiver decodes (:func:`decode_body`)."""
    return _encoder.encode(req)


def decode_body(body: bytes) -> ControlRequest:
    """The request a body holds, its constraints checked; :class:`ControlError` otherwise."""
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ControlError(f"bad control request: {exc}") from None


def encode_request(req: ControlRequest) -> list[bytes]:
    """The two parts to ``send_multipart`` on the publish socket. Raises
    :class:`ControlError` for a request the agents would refuse (checked by round trip:
    the constraints live on the type)."""
    body = encode_body(req)
    decode_body(body)
    return [control_topic(req.run), body]


def decode_request(parts: list[bytes]) -> ControlRequest:
    """The request of a received message; :class:`ControlError` if malformed, or if the
    body's run does not match the topic's."""
    if len(parts) != 2 or not parts[0].startswith(CONTROL_PREFIX) or not parts[0].endswith(_END):
        raise ControlError("control message must be [b'!ctl:<run>!', body]")
    req = decode_body(parts[1])
    if control_topic(req.run) != parts[0]:
        raise ControlError("control request's run does not match its topic")
    return req
