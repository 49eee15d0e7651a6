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
    "encode_request",
    "decode_request",
    "MAX_HZ",
    "MAX_SECONDS",
]

CONTROL_PREFIX = b"!ctl:"
_END = b"!"
#: Request bounds (PROTOCOL.md section 4, ``POST /stacks``).
MIN_HZ, MAX_HZ = 1, 250
MIN_SECONDS, MAX_SECONDS = 0.5, 60.0


class ControlError(ValueError):
    """A control message that does not have the documented shape."""


class ControlRequest(msgspec.Struct, omit_defaults=True, gc=False, forbid_unknown_fields=False):
    """One request for dumps of a run's ranks (module docstring)."""

    run: RunId
    request_id: Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID)]
    kind: Literal["stacks", "profile"]
    ranks: Optional[Annotated[list[Annotated[int, Meta(ge=0, lt=MAX_WORLD_SIZE)]],
                              Meta(min_length=1, max_length=MAX_WORLD_SIZE)]] = None
    hz: Annotated[int, Meta(ge=MIN_HZ, le=MAX_HZ)] = 100
    seconds: Annotated[float, Meta(ge=MIN_SECONDS, le=MAX_SECONDS)] = 5.0
    v: int = 1

    def asks(self, rank: int) -> bool:
        """Whether ``rank`` is one of the ranks asked (every rank when ``ranks`` is None)."""
        return self.ranks is None or rank in self.ranks


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ControlRequest)


def control_topic(run: str) -> bytes:
    """The topic an agent of ``run`` subscribes to (and nothing else matches it)."""
    return CONTROL_PREFIX + run.encode() + _END


def encode_request(run: str, request_id: str, kind: str, ranks: Optional[list[int]] = None,
                   hz: int = 100, seconds: float = 5.0) -> list[bytes]:
    """The two parts to ``send_multipart`` on the publish socket. Raises
    :class:`ControlError` for a request the agents would refuse (checked here, once)."""
    req = ControlRequest(run=run, request_id=request_id, kind=kind,  # type: ignore[arg-type]
                         ranks=None if ranks is None else list(ranks), hz=hz,
                         seconds=float(seconds))
    body = _encoder.encode(req)
    try:
        _decoder.decode(body)  # the constraints live on the type: validate by round trip
    except msgspec.ValidationError as exc:
        raise ControlError(f"bad control request: {exc}") from None
    return [control_topic(run), body]


def decode_request(parts: list[bytes]) -> ControlRequest:
    """The request of a received message; :class:`ControlError` if malformed, or if the
    body's run does not match the topic's."""
    if len(parts) != 2 or not parts[0].startswith(CONTROL_PREFIX) or not parts[0].endswith(_END):
        raise ControlError("control message must be [b'!ctl:<run>!', body]")
    try:
        req = _decoder.decode(parts[1])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ControlError(f"bad control request: {exc}") from None
    if control_topic(req.run) != parts[0]:
        raise ControlError("control request's run does not match its topic")
    return req
